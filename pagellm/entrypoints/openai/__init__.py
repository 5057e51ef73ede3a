"""The OpenAI-compatible HTTP server (`pagellm serve`): FastAPI app, request/response models, one
serving class per endpoint. FastAPI and pydantic are imported only under this package."""
