//! The models `serve` can run: our store, then ollama's (as the runner resolves `--model`), and
//! what the APIs say about each (details, template, parameters).

use serde_json::{json, Map, Value};
use std::path::PathBuf;
use store::{ModelName, Resolved, Store, StoreError};

pub struct Catalog {
    pub ours: Store,
    pub ollama: Option<Store>,
}

/// A model found by name.
pub struct Model {
    pub name: ModelName,
    pub resolved: Resolved,
    pub modelfile: store::Modelfile,
    pub size: u64,
    pub modified: std::time::SystemTime,
    /// `gemma4`, `glm-4.7` or empty: the family's renderer and parser.
    pub family: String,
    /// Where it was found (ours or ollama's store).
    pub root: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum FindError {
    #[error("{0}")]
    BadName(String),
    #[error("model '{0}' not found")]
    NotFound(String),
    #[error("{0}")]
    Store(#[from] StoreError),
}

impl Catalog {
    pub fn open(models: Option<PathBuf>) -> anyhow::Result<Catalog> {
        let root = match models {
            Some(r) => r,
            None => Store::default_root()?,
        };
        let ours = Store::open(root);
        let ollama = Store::ollama_root()
            .filter(|r| r != ours.root() && r.is_dir())
            .map(Store::open);
        Ok(Catalog { ours, ollama })
    }

    pub fn parse(name: &str) -> Result<ModelName, FindError> {
        name.trim().parse().map_err(FindError::BadName)
    }

    fn stores(&self) -> impl Iterator<Item = &Store> {
        std::iter::once(&self.ours).chain(self.ollama.as_ref())
    }

    /// The store that holds `name`, if any.
    pub fn store_of(&self, name: &ModelName) -> Option<&Store> {
        self.stores()
            .find(|s| matches!(s.manifest(name), Ok(Some(_))) && s.is_safetensors(name))
    }

    pub fn find(&self, name: &str) -> Result<Model, FindError> {
        let parsed = Self::parse(name)?;
        let Some(st) = self.store_of(&parsed) else {
            return Err(FindError::NotFound(name.to_string()));
        };
        let resolved = st.resolve(&parsed)?;
        let modelfile = store::show::modelfile(st, &resolved)?;
        let size = resolved.manifest.all_layers().map(|l| l.size).sum();
        let modified = std::fs::metadata(st.root().join("manifests").join(parsed.manifest_path()))
            .and_then(|m| m.modified())
            .unwrap_or(std::time::SystemTime::UNIX_EPOCH);
        let family = match resolved.config.renderer.as_str() {
            "" => family_of(&resolved),
            f => f.to_string(),
        };
        Ok(Model {
            name: parsed,
            resolved,
            modelfile,
            size,
            modified,
            family,
            root: st.root().to_path_buf(),
        })
    }

    /// Every model `serve` can run, ours first; a name in both stores is ours.
    pub fn list(&self) -> Vec<Model> {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for st in self.stores() {
            for l in st.list().unwrap_or_default() {
                if !st.is_safetensors(&l.name) || !seen.insert(l.name.clone()) {
                    continue;
                }
                if let Ok(m) = self.find(&l.name.to_string()) {
                    out.push(m);
                }
            }
        }
        out
    }
}

/// The family from the checkpoint's config.json, for models stored before the config blob
/// carried a renderer.
fn family_of(r: &Resolved) -> String {
    let cfg = read_json(r, "config.json").unwrap_or_default();
    let arch = format!(
        "{} {}",
        cfg["architectures"][0].as_str().unwrap_or_default(),
        cfg["model_type"].as_str().unwrap_or_default()
    )
    .to_lowercase();
    if arch.contains("gemma4") {
        "gemma4".into()
    } else if arch.contains("glm4") {
        "glm-4.7".into()
    } else {
        String::new()
    }
}

pub fn read_json(r: &Resolved, file: &str) -> Option<Value> {
    let p = r.target.files.get(file)?;
    serde_json::from_slice(&std::fs::read(p).ok()?).ok()
}

impl Model {
    /// The short name ollama prints (`name:tag`).
    pub fn display(&self) -> String {
        self.name.to_string()
    }

    pub fn digest(&self) -> &str {
        &self.resolved.digest
    }

    pub fn config_json(&self) -> Value {
        read_json(&self.resolved, "config.json").unwrap_or_default()
    }

    /// The chat template shipped with the checkpoint: tokenizer_config.json's, else
    /// chat_template.jinja (or chat_template.json's).
    pub fn chat_template(&self) -> Option<String> {
        let from_config = read_json(&self.resolved, "tokenizer_config.json")
            .and_then(|v| template_value(&v["chat_template"]));
        from_config
            .or_else(|| {
                let p = self.resolved.target.files.get("chat_template.jinja")?;
                std::fs::read_to_string(p).ok()
            })
            .or_else(|| {
                read_json(&self.resolved, "chat_template.json")
                    .and_then(|v| template_value(&v["chat_template"]))
            })
            .filter(|t| !t.trim().is_empty())
    }

    /// A special token's text from tokenizer_config.json (`bos_token`, `eos_token`).
    pub fn special_token(&self, key: &str) -> String {
        let v = read_json(&self.resolved, "tokenizer_config.json").unwrap_or_default();
        match &v[key] {
            Value::String(s) => s.clone(),
            Value::Object(o) => o
                .get("content")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            _ => String::new(),
        }
    }

    /// The tokenizer's special tokens by text (`<tool_call>` → its id).
    pub fn special_tokens(&self) -> std::collections::HashMap<String, u32> {
        read_json(&self.resolved, "tokenizer.json")
            .and_then(|v| v["added_tokens"].as_array().cloned())
            .into_iter()
            .flatten()
            .filter(|t| t["special"] == true)
            .filter_map(|t| Some((t["content"].as_str()?.to_string(), t["id"].as_u64()? as u32)))
            .collect()
    }

    pub fn parameter_count(&self) -> u64 {
        if self.resolved.config.part.parameter_count > 0 {
            return self.resolved.config.part.parameter_count;
        }
        store::show::precisions(&self.resolved.target)
            .map(|t| t.iter().map(|t| t.parameters).sum())
            .unwrap_or_default()
    }

    /// ollama's `ModelDetails`.
    pub fn details(&self) -> Value {
        let part = &self.resolved.config.part;
        let cfg = self.config_json();
        let family = cfg["model_type"]
            .as_str()
            .unwrap_or(part.model_type.as_str())
            .to_string();
        let quant = match part.file_type.as_str() {
            "" => cfg["torch_dtype"]
                .as_str()
                .or(cfg["dtype"].as_str())
                .map(|d| match d {
                    "bfloat16" => "BF16",
                    "float16" => "F16",
                    _ => "F32",
                })
                .unwrap_or("F32")
                .to_string(),
            t => t.to_uppercase(),
        };
        json!({
            "parent_model": "",
            "format": "safetensors",
            "family": family,
            "families": [family],
            "parameter_size": parameter_size(self.parameter_count()),
            "quantization_level": quant,
        })
    }

    pub fn capabilities(&self) -> Vec<String> {
        let caps = &self.resolved.config.capabilities;
        if caps.is_empty() {
            let mut c = vec!["completion".to_string()];
            if !self.family.is_empty() {
                c.extend(["tools".to_string(), "thinking".to_string()]);
            }
            c
        } else {
            caps.clone()
        }
    }

    /// The PARAMETERs as an options map.
    pub fn parameters(&self) -> Map<String, Value> {
        self.resolved.parameters.clone()
    }
}

fn template_value(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        // A list of named templates: the default one.
        Value::Array(items) => items
            .iter()
            .find(|t| t["name"] == "default")
            .or(items.first())
            .and_then(|t| t["template"].as_str().map(String::from)),
        _ => None,
    }
}

/// `1.2B`, `350M`, `12K`, as ollama formats parameter counts.
pub fn parameter_size(n: u64) -> String {
    let f = n as f64;
    if f >= 1e9 {
        format!("{:.1}B", f / 1e9)
    } else if f >= 1e6 {
        format!("{:.1}M", f / 1e6)
    } else if f >= 1e3 {
        format!("{:.1}K", f / 1e3)
    } else {
        n.to_string()
    }
}
