"""The DPU agent daemon (`nicoffload-agent`): runs the DPU-placed stages where request bytes arrive."""
