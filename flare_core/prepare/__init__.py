"""The export pipeline: resolve recipe, read checkpoint, map weights, plan capacities, write the core."""

from flare_core.prepare.export import ExportError, ExportRequest, ExportResult, export_model

__all__ = ["ExportError", "ExportRequest", "ExportResult", "export_model"]
