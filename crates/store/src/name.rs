//! Model names: `[host/][namespace/]model[:tag]`, as ollama writes them.

use std::fmt;
use std::path::PathBuf;

pub const DEFAULT_HOST: &str = "registry.ollama.ai";
pub const DEFAULT_NAMESPACE: &str = "library";
pub const DEFAULT_TAG: &str = "latest";

#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelName {
    pub host: String,
    pub namespace: String,
    pub model: String,
    pub tag: String,
}

fn valid_part(s: &str, max: usize) -> bool {
    !s.is_empty()
        && s.len() <= max
        && s.chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

impl std::str::FromStr for ModelName {
    type Err = String;

    fn from_str(s: &str) -> Result<ModelName, String> {
        let bad = |why: &str| {
            Err(format!(
                "invalid model name {s:?}: {why} (expected [host/][namespace/]name[:tag], letters, digits, '_', '-' and '.')"
            ))
        };
        let (path, tag) = match s.rsplit_once(':') {
            // A colon inside the host part (`host:port/ns/name`) is not a tag separator.
            Some((p, t)) if !t.contains('/') => (p, t),
            _ => (s, DEFAULT_TAG),
        };
        let parts: Vec<&str> = path.split('/').collect();
        let (host, namespace, model) = match parts.as_slice() {
            [m] => (DEFAULT_HOST, DEFAULT_NAMESPACE, *m),
            [ns, m] => (DEFAULT_HOST, *ns, *m),
            [h, ns, m] => (*h, *ns, *m),
            _ => return bad("too many '/'"),
        };
        if !valid_part(model, 80) {
            return bad("bad model part");
        }
        if !valid_part(namespace, 80) {
            return bad("bad namespace");
        }
        if !valid_part(tag, 80) {
            return bad("bad tag");
        }
        let host_ok = !host.is_empty()
            && host.len() <= 350
            && host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'));
        if !host_ok || host.contains("..") {
            return bad("bad host");
        }
        if [model, namespace, tag].iter().any(|p| p.contains("..")) {
            return bad("'..' is not allowed");
        }
        Ok(ModelName {
            host: host.to_string(),
            namespace: namespace.to_string(),
            model: model.to_string(),
            tag: tag.to_string(),
        })
    }
}

impl ModelName {
    /// The manifest's path below `manifests/`.
    pub fn manifest_path(&self) -> PathBuf {
        [&self.host, &self.namespace, &self.model, &self.tag]
            .iter()
            .collect()
    }
}

impl fmt::Display for ModelName {
    /// The short form ollama prints: default host and namespace left out.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host != DEFAULT_HOST {
            write!(f, "{}/{}/", self.host, self.namespace)?;
        } else if self.namespace != DEFAULT_NAMESPACE {
            write!(f, "{}/", self.namespace)?;
        }
        write!(f, "{}:{}", self.model, self.tag)
    }
}
