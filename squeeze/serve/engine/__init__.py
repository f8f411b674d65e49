"""The engine room of ``squeeze serve``: requests in, tokens out, one continuously batched model step at a time
(squeeze.serve.engine.engine.Engine). Nothing here speaks HTTP: the HTTP room (squeeze.serve.http) reaches the
engine through squeeze.serve.types.EngineClient."""
