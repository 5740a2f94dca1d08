"""The driver's view of a replica process when the replica dies mid-answer."""

from __future__ import annotations

import socket
import threading

from opencomposer.rl.services import ReplicaProcess


def _truncating_server() -> tuple[str, threading.Thread]:
    """An HTTP server that promises 209 bytes of body and closes after one: what a replica that is
    killed while it answers leaves behind (http.client raises IncompleteRead, not an OSError)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def serve():
        for _ in range(2):
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 209\r\n\r\n{")
        srv.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}/v1", t


def test_a_replica_that_dies_mid_answer_reads_as_not_answering():
    url, t = _truncating_server()
    replica = object.__new__(ReplicaProcess)  # the health and threads calls only, no process
    replica._url, replica._health, replica._health_at, replica._admin_token = url, {"status": "ok"}, 0.0, "x"
    assert replica.health(max_age_s=0.0) == {}  # not an exception: the loop then replaces the replica
    assert replica.set_threads(1) is False
    t.join(timeout=10)


def test_a_refusal_made_before_the_replica_saw_the_last_snapshot_is_already_answered():
    from opencomposer.rl.services import answered

    # v5 corrupt (seen 5), v6 a delta against it (seen 6); the driver published full v7 for the first
    assert not answered([{"version": 4, "seen": 5}], -1)  # nothing published yet: answer it
    assert answered([{"version": 4, "seen": 6}], 7)  # the second refusal: v7 answers it too
    assert not answered([{"version": 4, "seen": 7}], 7)  # the snapshot itself refused: answer again
    assert not answered([{"version": 4, "seen": 6}, {"version": 4, "seen": 7}], 7)
    assert not answered([{"version": 4}], 7) and not answered([], 7)  # no `seen` (an older replica): answer
