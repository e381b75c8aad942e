"""engine_svc: token ids in, token ids streamed out, behind one backend interface."""
