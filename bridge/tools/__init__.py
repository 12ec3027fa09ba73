"""Tools on a training graph: check (what a target compiler rejects), compile, show, verify."""
