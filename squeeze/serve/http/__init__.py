"""The HTTP room of ``squeeze serve``: the OpenAI-compatible FastAPI app (squeeze.serve.http.app), its request
schemas, responses, errors, metrics and connection limits, over any squeeze.serve.types.EngineClient."""
