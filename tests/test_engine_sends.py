"""The engine drops finished sends from the front of its list (posting order) only."""
from threefold.runtime.comm import drop_finished


class _Send:
    def __init__(self, done):
        self._done = done
        self.calls = 0

    def done(self):
        self.calls += 1
        return self._done


def test_drops_the_finished_prefix_and_keeps_the_rest_in_order():
    sends = [_Send(True), _Send(True), _Send(False), _Send(True)]
    pending, last = sends[2], sends[3]
    drop_finished(sends)
    assert sends == [pending, last]
    assert last.calls == 0          # not asked: the first pending send stops the scan


def test_nothing_finished_or_nothing_pending():
    sends = [_Send(False), _Send(True)]
    drop_finished(sends)
    assert len(sends) == 2
    done = [_Send(True), _Send(True)]
    drop_finished(done)
    assert done == []
