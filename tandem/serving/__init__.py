"""What the three services share: KV residency in Redis and the routing policy that reads it,
metrics, tracing, logging, the gRPC server helper, and the one module (`protoconv`) that converts
between domain objects and `tandem.v1` messages. Never imports `tandem.tools`."""
