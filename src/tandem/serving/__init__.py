"""Serving on Ray: server (one engine per actor), replica, server manager, load balancer, clients.

Import from the modules (tandem.serving.manager, .client, ...); this package imports nothing so
that a Ray worker unpickling the balancer does not load torch.
"""
