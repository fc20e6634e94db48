"""The distributed runtime: point-to-point transfer, launch, fault reports and checkpoints."""

__all__: list[str] = []
