"""Moving artifacts between machines: ``squeeze pull`` (HTTP(S) or the Hugging Face Hub, verified while it
streams) and ``squeeze push`` (upload to the Hub)."""
