"""Turnstile: the `turnstile` command here, and, installed beneath it from the repository's
top-level folders, the services (`scheduler_svc`, `executor_svc`, `gateway_svc`), `kernels`,
`shared` and `bench`."""
