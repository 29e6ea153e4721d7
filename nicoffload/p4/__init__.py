"""The NIC data plane's control plane: a Plan + Topology become P4Runtime table entries.

`p4/nicoffload.p4` parses nicoffload frames carried in UDP and steers each by (pipeline id,
stage id); this package decides those ids, reads each device's NIC port from the topology's
`p4:` section, and writes and validates the entries (as P4Runtime, or as BMv2 CLI commands).
`toolchain` and `switch` compile the program with p4c and run it on BMv2 for the tests.
Protobufs and scapy are imported lazily.
"""

from __future__ import annotations

from pathlib import Path

# The UDP destination port of nicoffload frames on the NIC path (p4/nicoffload.p4 has the same).
UDP_PORT = 7700
# The repository's p4/ folder: the program and its P4Info live there, next to the package.
P4_DIR = Path(__file__).resolve().parents[2] / "p4"
P4_SOURCE = P4_DIR / "nicoffload.p4"
P4INFO = P4_DIR / "nicoffload.p4info.txtpb"
