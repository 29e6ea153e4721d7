"""`serve --fronts 2`: a front sent SIGTERM on its own (not the serve process) drains, exits and
is restarted; it does not stay up answering 503 to its share of the connections for ever,
waiting for an `exit` that only the serve process's own drain sends; sent with serve, it waits
for serve's drain (no restart)."""

from __future__ import annotations

import os
import re
import signal

import numpy as np
import tritonclient.http as httpclient
from serve_process import MODEL, Served, host_plan, wait_until
from tritonclient.utils import InferenceServerException

from nicoffload.samples import sample_images


def test_a_front_sent_sigterm_alone_is_restarted_not_left_answering_503(tmp_path):
    blob = sample_images(1, 3)[0][1]
    s = Served(["--plan", str(host_plan(tmp_path)), "--fronts", "2"], tmp_path / "serve.log")
    try:
        os.kill(s.doc["front_pids"][0], signal.SIGTERM)
        wait_until(lambda: "front 0 restarted" in s.log.read_text(), "front 0 to restart")

        def one() -> str:  # a new connection each: either front takes it
            i = httpclient.InferInput("image", [1], "BYTES")
            i.set_data_from_numpy(np.array([blob], dtype=object), binary_data=True)
            try:
                httpclient.InferenceServerClient(s.hostport).infer(MODEL, [i])
            except InferenceServerException as exc:
                return f"status {exc.status()}"
            return "ok"

        assert [one() for _ in range(8)] == ["ok"] * 8
        # SIGTERM to serve and its fronts together (a service manager stopping the group):
        # the fronts that drain first wait for serve's drain, none is restarted
        for pid in [*s.doc["front_pids"][1:], restarted_pid(s), s.proc.pid]:
            os.kill(pid, signal.SIGTERM)
        assert s.proc.wait(60) == 0
        assert s.log.read_text().count("restarted") == 1
    finally:
        if s.proc.poll() is None:
            s.stop()


def restarted_pid(s: Served) -> int:
    return int(re.search(r"front 0 restarted \(pid (\d+)\)", s.log.read_text())[1])
