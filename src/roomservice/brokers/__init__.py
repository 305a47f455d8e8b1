"""Brokers: the port (``port``), its fake, and the embedded, NATS JetStream and RocketMQ 5 adapters."""
