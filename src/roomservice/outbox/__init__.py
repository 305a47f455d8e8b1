"""The outbox worker: claim due rows, publish them by mode, finish them; retention and admin."""
