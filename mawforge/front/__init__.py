"""What the Python API (api.py) and the OpenAI server (serve/) both take a request with: chat
options and tool-call shaping (chatreq), the request fields and their errors (protocol), response
formats as decoding constraints (structured). Below both, so the server stands on the API."""
