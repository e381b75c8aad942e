"""router_svc: the client-facing front door (auth, admission, routing, streaming)."""
