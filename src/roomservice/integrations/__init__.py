"""Clients for services outside the room (Tencent Cloud IM) and local stand-ins for them.

* :mod:`roomservice.integrations.tencent_im` — the Tencent IM REST client (UserSig,
  error classification, client-side rate limit).
* :mod:`roomservice.integrations.im_sandbox` — a local HTTP server speaking the same REST
  subset, with a control API to inject outages, error codes and latency.
"""
