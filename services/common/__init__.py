"""The shared ground floor: what every role uses — config, errors, logging, metrics, gRPC and HTTP
server helpers, the adapter file layout — and, under `scheduling/`, what the gateway and the worker
share about batches, step times and adapter tiers. It imports no role and no command."""
