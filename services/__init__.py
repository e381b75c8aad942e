"""tokenrelay's shared library: config, logging, errors, gRPC helpers, generated stubs, client."""

__version__ = "0.1.0"
