"""Code shared by the two torch backends (FSDP1 and DTensor)."""
