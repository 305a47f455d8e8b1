"""room-service: live voice-chat rooms whose side effects leave through a transactional outbox."""

__version__ = "0.1.0"
