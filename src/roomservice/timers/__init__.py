"""Timers: the durable treasure wake-up timer in the database and the loop that fires it."""
