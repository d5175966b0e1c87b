"""The ``shopper`` command: the embedded stack, the event producer, the runner and read-back tools."""
