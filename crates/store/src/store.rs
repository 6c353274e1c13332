//! The model store: content-addressed blobs and manifests, in ollama's layout.
//!
//! ```text
//! $MLX_RUNNER_MODELS (default ~/.mlx-runner/models)
//! ├── blobs/sha256-<hex>                                  tensors (safetensors), JSON, text
//! └── manifests/<host>/<namespace>/<model>/<tag>          which blobs make up a model
//! ```
//!
//! Every file is written to a temporary name, synced and renamed into place, and a manifest is
//! written only after all of its blobs: a writer killed at any moment leaves the old manifest or
//! the new one, never one that names a missing blob. Writers (create, rm) hold an exclusive lock
//! on `<root>/.lock`, so one writer's clean-up never races another's fresh blobs; readers take
//! no lock, since renames are atomic.

use crate::manifest::{media, Layer, Manifest, ModelConfig};
use crate::name::ModelName;
use crate::{Result, StoreError};
use base::files::ModelFiles;
use sha2::{Digest, Sha256};
use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Temporary files carry this in their names; a writer holding the lock removes any it finds.
const PARTIAL: &str = ".partial-";

pub struct Store {
    root: PathBuf,
}

/// An exclusive hold on the store for writing.
pub struct WriteLock {
    _file: File,
}

/// A stored model, ready to load.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub name: ModelName,
    /// sha256 of the manifest: the model's identity (`list` shows its first 12 digits).
    pub digest: String,
    pub manifest: Manifest,
    pub config: ModelConfig,
    pub target: ModelFiles,
    pub draft: Option<ModelFiles>,
    /// The Modelfile's PARAMETERs (`stop` as a list).
    pub parameters: serde_json::Map<String, serde_json::Value>,
}

/// One `list` row.
#[derive(Debug, Clone)]
pub struct Listed {
    pub name: ModelName,
    pub digest: String,
    pub size: u64,
    pub modified: std::time::SystemTime,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io {
        path: path.to_path_buf(),
        cause: source,
    }
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Writes `bytes` to `dest` atomically: a temporary sibling, synced, then renamed.
fn write_atomic(dest: &Path, bytes: &[u8]) -> Result<()> {
    let dir = dest.parent().expect("store paths have a parent");
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = dir.join(format!(
        "{PARTIAL}{}-{}",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, dest)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io(dest))
}

fn sync_dir(dir: &Path) {
    // Durability across power loss; atomicity does not depend on it, so failures are ignored.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

impl Store {
    pub fn open(root: impl Into<PathBuf>) -> Store {
        Store { root: root.into() }
    }

    /// `$MLX_RUNNER_MODELS`, else `~/.mlx-runner/models`.
    pub fn default_root() -> Result<PathBuf> {
        if let Some(p) = std::env::var_os("MLX_RUNNER_MODELS").filter(|p| !p.is_empty()) {
            return Ok(PathBuf::from(p));
        }
        let home = std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .ok_or_else(|| {
                StoreError::Invalid(
                    "neither MLX_RUNNER_MODELS nor HOME is set: cannot find the model store".into(),
                )
            })?;
        Ok(PathBuf::from(home).join(".mlx-runner/models"))
    }

    /// ollama's own store: `$OLLAMA_MODELS`, else `~/.ollama/models`. Models ollama created
    /// (`ollama create --experimental`) are read from there when ours has no such name.
    pub fn ollama_root() -> Option<PathBuf> {
        if let Some(p) = std::env::var_os("OLLAMA_MODELS").filter(|p| !p.is_empty()) {
            return Some(PathBuf::from(p));
        }
        let home = std::env::var_os("HOME").filter(|h| !h.is_empty())?;
        Some(PathBuf::from(home).join(".ollama/models"))
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    fn blobs(&self) -> PathBuf {
        self.root.join("blobs")
    }

    fn manifests(&self) -> PathBuf {
        self.root.join("manifests")
    }

    /// `sha256:<hex>` → `blobs/sha256-<hex>`.
    pub fn blob_path(&self, digest: &str) -> Result<PathBuf> {
        let hex = digest
            .strip_prefix("sha256:")
            .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
            .ok_or_else(|| StoreError::Invalid(format!("malformed blob digest {digest:?}")))?;
        Ok(self.blobs().join(format!("sha256-{hex}")))
    }

    fn manifest_path(&self, name: &ModelName) -> PathBuf {
        self.manifests().join(name.manifest_path())
    }

    /// The file writers lock, opened (created when missing), and its path.
    fn lock_file(&self) -> Result<(File, PathBuf)> {
        let path = self.root.join(".lock");
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(io(&path))?;
        Ok((file, path))
    }

    /// Takes the store's write lock (waiting for another writer), then removes temporary files
    /// that killed writers left behind.
    pub fn lock(&self) -> Result<WriteLock> {
        std::fs::create_dir_all(&self.root).map_err(io(&self.root))?;
        let (file, path) = self.lock_file()?;
        file.lock().map_err(io(&path))?;
        for dir in [self.blobs(), self.manifests()] {
            remove_partials(&dir);
        }
        Ok(WriteLock { _file: file })
    }

    /// Stores `bytes` as a blob (once: an intact blob with the same digest is kept, a damaged
    /// one replaced).
    pub fn write_blob(&self, _lock: &WriteLock, media_type: &str, bytes: &[u8]) -> Result<Layer> {
        let hex = sha256_hex(bytes);
        let digest = format!("sha256:{hex}");
        let path = self.blob_path(&digest)?;
        let intact = std::fs::metadata(&path).is_ok_and(|m| m.len() == bytes.len() as u64)
            && base::files::sha256_file(&path).is_ok_and(|h| h == hex);
        if !intact {
            write_atomic(&path, bytes)?;
        }
        Ok(Layer {
            media_type: media_type.to_string(),
            digest,
            size: bytes.len() as u64,
            name: None,
        })
    }

    /// Whether the blob `digest` is stored (by size; contents are checked on load).
    pub fn has_blob(&self, digest: &str) -> bool {
        self.blob_path(digest).is_ok_and(|p| p.is_file())
    }

    /// Where uploads are written before they become blobs: outside `blobs/`, so a sweep for
    /// killed writers' files never takes an upload in progress.
    pub fn uploads(&self) -> PathBuf {
        self.root.join("uploads")
    }

    /// Moves the uploaded file `tmp` (in [`Store::uploads`]) into place as blob `digest`, which
    /// the caller has checked its contents against.
    pub fn adopt_blob(&self, _lock: &WriteLock, tmp: &Path, digest: &str) -> Result<()> {
        let dest = self.blob_path(digest)?;
        std::fs::create_dir_all(self.blobs()).map_err(io(&self.blobs()))?;
        std::fs::rename(tmp, &dest).map_err(io(&dest))?;
        sync_dir(&self.blobs());
        Ok(())
    }

    /// Points `name` at `manifest` (whose blobs must all be written), replacing what it named.
    pub fn write_manifest(
        &self,
        _lock: &WriteLock,
        name: &ModelName,
        manifest: &Manifest,
    ) -> Result<String> {
        for l in manifest.all_layers() {
            let p = self.blob_path(&l.digest)?;
            let ok = std::fs::metadata(&p).is_ok_and(|m| m.len() == l.size);
            if !ok {
                return Err(StoreError::Invalid(format!(
                    "refusing to write manifest {name}: blob {} is missing",
                    l.digest
                )));
            }
        }
        sync_dir(&self.blobs());
        let bytes = manifest.to_bytes();
        let path = self.manifest_path(name);
        write_atomic(&path, &bytes)?;
        sync_dir(path.parent().expect("manifest has a parent"));
        Ok(sha256_hex(&bytes))
    }

    /// The manifest `name` points at, and its digest.
    pub fn manifest(&self, name: &ModelName) -> Result<Option<(Manifest, String)>> {
        let path = self.manifest_path(name);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(&path)(e)),
        };
        let m: Manifest = serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
            path: path.clone(),
            message: format!("not a valid manifest: {e}"),
        })?;
        Ok(Some((m, sha256_hex(&bytes))))
    }

    fn require(&self, name: &ModelName) -> Result<(Manifest, String)> {
        self.manifest(name)?
            .ok_or_else(|| StoreError::NotFound(name.clone()))
    }

    /// Every stored model, sorted by name.
    pub fn list(&self) -> Result<Vec<Listed>> {
        let mut out = Vec::new();
        for path in manifest_files(&self.manifests())? {
            let Some(name) = self.name_of(&path) else {
                continue;
            };
            // One unreadable manifest does not hide the others (`check` reports it).
            let Ok(Some((m, digest))) = self.manifest(&name) else {
                continue;
            };
            let modified = std::fs::metadata(&path)
                .and_then(|m| m.modified())
                .map_err(io(&path))?;
            out.push(Listed {
                size: m.all_layers().map(|l| l.size).sum(),
                name,
                digest,
                modified,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Whether the model `name` is one mlx-runner can load: its config blob says
    /// `model_format: safetensors` (ollama's store also holds GGUF models, which it cannot).
    pub fn is_safetensors(&self, name: &ModelName) -> bool {
        let Ok(Some((m, _))) = self.manifest(name) else {
            return false;
        };
        let Ok(path) = self.blob_path(&m.config.digest) else {
            return false;
        };
        std::fs::read(path)
            .ok()
            .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .is_some_and(|v| v["model_format"] == "safetensors")
    }

    fn name_of(&self, manifest_file: &Path) -> Option<ModelName> {
        let rel = manifest_file.strip_prefix(self.manifests()).ok()?;
        let parts: Vec<&str> = rel.iter().filter_map(|p| p.to_str()).collect();
        match parts.as_slice() {
            [h, ns, m, t] => format!("{h}/{ns}/{m}:{t}").parse().ok(),
            _ => None,
        }
    }

    /// Removes `name`, then every blob no remaining manifest uses. Returns the blobs removed
    /// and their bytes.
    pub fn remove(&self, name: &ModelName) -> Result<(usize, u64)> {
        let lock = self.lock()?;
        self.require(name)?;
        let path = self.manifest_path(name);
        std::fs::remove_file(&path).map_err(io(&path))?;
        // Empty parent folders go too, up to manifests/.
        let mut dir = path.parent();
        while let Some(d) = dir.filter(|d| *d != self.manifests()) {
            if std::fs::remove_dir(d).is_err() {
                break;
            }
            dir = d.parent();
        }
        self.collect_garbage(&lock)
    }

    /// Removes blobs that no manifest names (left by killed writers or replaced models).
    pub fn collect_garbage(&self, _lock: &WriteLock) -> Result<(usize, u64)> {
        let mut used = BTreeSet::new();
        for path in manifest_files(&self.manifests())? {
            let Some(name) = self.name_of(&path) else {
                continue;
            };
            // A manifest we cannot read keeps every blob: never delete on a guess.
            let Ok((m, _)) = self.require(&name) else {
                return Ok((0, 0));
            };
            for l in m.all_layers() {
                let Ok(p) = self.blob_path(&l.digest) else {
                    return Ok((0, 0));
                };
                used.insert(p);
            }
        }
        let mut removed = (0, 0);
        let entries = match std::fs::read_dir(self.blobs()) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
            Err(e) => return Err(io(&self.blobs())(e)),
        };
        for e in entries.flatten() {
            let p = e.path();
            let is_blob = p
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("sha256-"));
            if is_blob && !used.contains(&p) {
                let size = e.metadata().map(|m| m.len()).unwrap_or(0);
                std::fs::remove_file(&p).map_err(io(&p))?;
                removed.0 += 1;
                removed.1 += size;
            }
        }
        Ok(removed)
    }

    /// Problems with the store: manifests naming missing, truncated or altered blobs.
    pub fn check(&self) -> Result<Vec<String>> {
        let mut problems = Vec::new();
        for path in manifest_files(&self.manifests())? {
            let Some(name) = self.name_of(&path) else {
                problems.push(format!("{}: not a manifest path", path.display()));
                continue;
            };
            let (m, _) = match self.require(&name) {
                Ok(m) => m,
                Err(e) => {
                    problems.push(e.to_string());
                    continue;
                }
            };
            for l in m.all_layers() {
                let p = self.blob_path(&l.digest)?;
                match base::files::sha256_file(&p) {
                    Ok(h) if format!("sha256:{h}") == l.digest => {}
                    Ok(_) => problems.push(format!("{name}: blob {} is altered", l.digest)),
                    Err(_) => problems.push(format!("{name}: blob {} is missing", l.digest)),
                }
            }
        }
        Ok(problems)
    }

    /// The stored model `name`, as files to load: blobs under their checkpoint names, the
    /// draft's (`draft/...`, `draft.`-prefixed tensors) apart. Digests are checked on load.
    pub fn resolve(&self, name: &ModelName) -> Result<Resolved> {
        let (manifest, digest) = self.require(name)?;
        let config_path = self.blob_path(&manifest.config.digest)?;
        let bytes = std::fs::read(&config_path).map_err(io(&config_path))?;
        if format!("sha256:{}", sha256_hex(&bytes)) != manifest.config.digest {
            return Err(StoreError::Corrupt {
                path: config_path,
                message: "the model config blob does not match its digest".into(),
            });
        }
        let config: ModelConfig =
            serde_json::from_slice(&bytes).map_err(|e| StoreError::Corrupt {
                path: config_path.clone(),
                message: format!("not a valid model config: {e}"),
            })?;
        let (target, draft) = self.files_of(name, &manifest, &config)?;
        let parameters = match manifest.layer(media::PARAMS) {
            Some(l) => {
                serde_json::from_str(&self.read_text(l)?).map_err(|e| StoreError::Corrupt {
                    path: self.blob_path(&l.digest).unwrap_or_default(),
                    message: format!("parameters are not a JSON object: {e}"),
                })?
            }
            None => Default::default(),
        };
        Ok(Resolved {
            name: name.clone(),
            digest,
            manifest,
            config,
            target,
            draft,
            parameters,
        })
    }

    /// The files of `manifest` as the runner will load them (see [`Store::resolve`]).
    pub fn files_of(
        &self,
        name: &ModelName,
        manifest: &Manifest,
        config: &ModelConfig,
    ) -> Result<(ModelFiles, Option<ModelFiles>)> {
        let origin = PathBuf::from(name.to_string());
        let empty = |origin: PathBuf, prefix: &str| ModelFiles {
            origin,
            files: HashMap::new(),
            tensors: Vec::new(),
            tensor_prefix: prefix.to_string(),
            digests: Vec::new(),
        };
        let draft_prefix = config
            .draft
            .as_ref()
            .map_or("draft.", |d| d.tensor_prefix.as_str());
        let mut target = empty(origin.clone(), "");
        let mut draft = empty(origin.join("draft"), draft_prefix);
        for l in &manifest.layers {
            let path = self.blob_path(&l.digest)?;
            let layer_name = l.name.as_deref().unwrap_or_default();
            let files = match l.media_type.as_str() {
                media::TENSOR => {
                    let files = if layer_name.starts_with(draft_prefix) {
                        &mut draft
                    } else {
                        &mut target
                    };
                    files.tensors.push(path.clone());
                    files
                }
                media::JSON => match layer_name.strip_prefix("draft/") {
                    Some(f) => {
                        draft.files.insert(f.to_string(), path.clone());
                        &mut draft
                    }
                    None => {
                        target.files.insert(layer_name.to_string(), path.clone());
                        &mut target
                    }
                },
                _ => continue,
            };
            files
                .digests
                .push((path, l.digest["sha256:".len()..].to_string()));
        }
        let has_draft = config.draft.is_some() || draft.files.contains_key("config.json");
        Ok((target, has_draft.then_some(draft)))
    }

    /// The text of a stored text layer (template, system, license, parameters), checked
    /// against its digest like every other blob.
    pub fn read_text(&self, layer: &Layer) -> Result<String> {
        let p = self.blob_path(&layer.digest)?;
        let bytes = std::fs::read(&p).map_err(io(&p))?;
        if format!("sha256:{}", sha256_hex(&bytes)) != layer.digest {
            return Err(StoreError::Corrupt {
                path: p,
                message: "the blob does not match its digest".into(),
            });
        }
        String::from_utf8(bytes).map_err(|_| StoreError::Corrupt {
            path: p,
            message: "a text blob that is not UTF-8".into(),
        })
    }

    /// Removes the temporary files that a killed writer left behind, when no writer is at
    /// work (a live one holds the lock: its files are left alone). Returns the files and bytes
    /// removed, or `None` when a writer holds the lock. Any store command may call it.
    pub fn sweep_partials(&self) -> Result<Option<(usize, u64)>> {
        if !self.root.is_dir() {
            return Ok(Some((0, 0)));
        }
        let (file, path) = self.lock_file()?;
        match file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => return Ok(None),
            Err(std::fs::TryLockError::Error(e)) => return Err(io(&path)(e)),
        }
        let mut swept = (0, 0);
        for dir in [self.blobs(), self.manifests()] {
            let (n, b) = remove_partials(&dir);
            swept = (swept.0 + n, swept.1 + b);
        }
        Ok(Some(swept))
    }
}

/// Removes the partial files below `dir`; returns how many and their bytes.
fn remove_partials(dir: &Path) -> (usize, u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return (0, 0);
    };
    let mut removed = (0, 0);
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name();
        if name.to_string_lossy().starts_with(PARTIAL) {
            let size = e.metadata().map_or(0, |m| m.len());
            if std::fs::remove_file(&p).is_ok() {
                removed = (removed.0 + 1, removed.1 + size);
            }
        } else if e.file_type().is_ok_and(|t| t.is_dir()) {
            let (n, b) = remove_partials(&p);
            removed = (removed.0 + n, removed.1 + b);
        }
    }
    removed
}

/// Manifest files below `dir` (four levels: host/namespace/model/tag), skipping partials.
fn manifest_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), 0)];
    while let Some((d, depth)) = stack.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io(&d)(e)),
        };
        for e in entries.flatten() {
            let p = e.path();
            if e.file_name().to_string_lossy().starts_with(PARTIAL) {
                continue;
            }
            let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
            match (is_dir, depth) {
                (true, 0..=2) => stack.push((p, depth + 1)),
                (false, 3) => out.push(p),
                _ => {}
            }
        }
    }
    out.sort();
    Ok(out)
}
