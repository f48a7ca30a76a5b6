"""dualrl core: everything that is the same for every training backend."""
