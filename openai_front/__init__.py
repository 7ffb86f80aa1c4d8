"""An OpenAI-compatible API in front of the Triton server (server.py); `python -m openai_front --help`."""
