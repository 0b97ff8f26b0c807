"""The speculative engine every service reuses: model loading and the native forward, the target
runner and its KV cache, proposers, the block-length controller, verification and sampling, and
the single-process decode loop (`spec.Engine`) that is the oracle of the distributed system.

Imports neither grpc, protobuf nor `tandem.tools` (tests/test_layout.py enforces it)."""
