//! Reading a model directory's JSON files with errors that name the file and the field.

use crate::{ModelError, Result};
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::path::{Path, PathBuf};

/// A parsed JSON file and where it came from.
pub struct JsonFile {
    pub path: PathBuf,
    pub value: Value,
}

impl JsonFile {
    pub fn read(path: &Path) -> Result<JsonFile> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.to_path_buf(),
            cause: source,
        })?;
        let value = serde_json::from_str(&text).map_err(|e| ModelError::Config {
            path: path.to_path_buf(),
            message: format!("not valid JSON: {e}"),
        })?;
        Ok(JsonFile {
            path: path.to_path_buf(),
            value,
        })
    }

    /// Reads the file if it exists.
    pub fn read_optional(path: &Path) -> Result<Option<JsonFile>> {
        if path.is_file() {
            Self::read(path).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn error(&self, message: impl Into<String>) -> ModelError {
        ModelError::Config {
            path: self.path.clone(),
            message: message.into(),
        }
    }

    /// Deserializes `value` (this file or a part of it) into `T`; a missing or mistyped field is
    /// an error naming it.
    pub fn parse<T: DeserializeOwned>(&self, value: &Value) -> Result<T> {
        serde_json::from_value(value.clone()).map_err(|e| self.error(e.to_string()))
    }

    pub fn model_type(&self) -> Result<String> {
        self.value
            .get("model_type")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| self.error("missing field `model_type`"))
    }
}

/// `eos_token_id` written as an integer or a list of integers.
pub fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}
