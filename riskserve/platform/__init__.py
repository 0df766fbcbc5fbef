"""The platform: the BaseModel interface, the lifecycle host, artifacts and the error tree."""

from riskserve.platform.artifacts import Artifact, ArtifactManifest, open_artifact, write_manifest
from riskserve.platform.base_model import BaseModel, ModelMetadata, ModelOutput, ModelSettings
from riskserve.platform.errors import (
    ArtifactIntegrityError,
    ConfigError,
    Conflict,
    DeadlineExceeded,
    InvalidInput,
    MissingExtra,
    ModelLoadError,
    ModelUnavailable,
    NotFound,
    Overloaded,
    RiskServeError,
)
from riskserve.platform.host import ModelHost
from riskserve.platform.validation import FeatureMatrix, check_feature_matrix, check_texts

__all__ = [
    "Artifact",
    "ArtifactIntegrityError",
    "ArtifactManifest",
    "BaseModel",
    "ConfigError",
    "Conflict",
    "DeadlineExceeded",
    "FeatureMatrix",
    "InvalidInput",
    "MissingExtra",
    "ModelHost",
    "ModelLoadError",
    "ModelMetadata",
    "ModelOutput",
    "ModelSettings",
    "ModelUnavailable",
    "NotFound",
    "Overloaded",
    "RiskServeError",
    "check_feature_matrix",
    "check_texts",
    "open_artifact",
    "write_manifest",
]
