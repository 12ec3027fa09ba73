"""The conversion pipeline, stage by stage: load -> import -> trace (with the lowerings) -> export -> annotate (docs/ARCHITECTURE.md)."""
