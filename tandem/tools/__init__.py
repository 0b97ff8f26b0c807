"""What a user runs and no service imports: the CLI, benchmarks, the load test, distillation,
plots, prompt sets, and the local stack with its demo."""
