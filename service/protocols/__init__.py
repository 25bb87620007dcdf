"""The protocols layer: what a request means (OpenAI, KServe V2, classification, model control). It calls the
engine and answers its errors with statuses; it imports service.base and service.engine only."""
