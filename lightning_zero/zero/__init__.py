"""ZeRO engines: partition math, flat buffers and the per-stage engines."""
