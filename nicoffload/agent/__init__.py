"""The host's side of the DPU agent: its protocol (what each frame kind carries), the
authentication both ends share (the token file, the handshake's proofs and session keys), the
client the runtime drives a loaded stage with, and the launcher of a local agent process. The
daemon itself is `dpu_agents/` (it imports this package; this package never imports it)."""
