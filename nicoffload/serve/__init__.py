"""Serving: the Open Inference Protocol (KServe v2) endpoint in front of a Session
(`kserve` the wire format, `batcher` the one long-lived stream, `server` the aiohttp app),
and `loadgen`, its load generator. aiohttp is imported only by the modules that need it."""
