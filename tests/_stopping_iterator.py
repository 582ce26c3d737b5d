"""A training-data iterator that stops a run at a known batch (imported by tests and their subprocess scripts)."""


class StoppingIterator:
    """Wraps a train iterator (``get_state`` / ``set_state`` pass through); asked for batch ``n + 1``, it calls
    ``stop()`` (which raises, or blocks until the process is killed) instead."""

    def __init__(self, it, n, stop):
        self.it, self.left, self.stop = it, n, stop

    def __iter__(self):
        return self

    def __next__(self):
        if self.left == 0:
            self.stop()
        self.left -= 1
        return next(self.it)

    def get_state(self):
        return self.it.get_state()

    def set_state(self, state):
        self.it.set_state(state)
