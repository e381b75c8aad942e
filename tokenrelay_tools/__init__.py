"""Tooling around the mesh: the `tokenrelay` CLI and launcher, the load generator, the default-model build.

No service imports this package; it imports the services' public pieces (the client, the launcher's
processes are the services' own `python -m` entry points).
"""
