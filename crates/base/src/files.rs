//! Where a model's files are: a checkpoint directory, or blobs of the model store.
//!
//! Loading code asks for files by their checkpoint names (`config.json`, `tokenizer.json`) and
//! for the list of safetensors files; a store hands out content-addressed blobs under those
//! names, with the digests they must have.

use serde_json::Value;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

/// Why a model's files cannot be used: the file at fault and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    /// The cause is part of the message and deliberately not a `source()`: a CLI that prints
    /// the chain would print it twice.
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
}

pub type Result<T> = std::result::Result<T, FileError>;

/// The files one model (a target or a draft) loads from.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// What errors and logs call the model: its directory, or its store name.
    pub origin: PathBuf,
    /// Checkpoint file names (`config.json`, ...) and where each one is.
    pub files: HashMap<String, PathBuf>,
    /// The safetensors files holding the weights.
    pub tensors: Vec<PathBuf>,
    /// A prefix every tensor name carries in these files (the store's `draft.`), removed on load;
    /// tensors without it are ignored.
    pub tensor_prefix: String,
    /// Files to check against their sha256 (lowercase hex) before anything is read from them.
    pub digests: Vec<(PathBuf, String)>,
}

/// The JSON and tokenizer files a checkpoint directory may carry, besides its weights.
pub const CHECKPOINT_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "processor_config.json",
];

impl ModelFiles {
    /// A checkpoint directory: its known files that exist, and its shards.
    pub fn dir(dir: &Path) -> Result<ModelFiles> {
        if !dir.is_dir() {
            return Err(FileError::Io {
                path: dir.to_path_buf(),
                cause: std::io::Error::new(std::io::ErrorKind::NotFound, "no such model directory"),
            });
        }
        let files = CHECKPOINT_FILES
            .iter()
            .map(|n| (n.to_string(), dir.join(n)))
            .filter(|(_, p)| p.is_file())
            .collect();
        Ok(ModelFiles {
            origin: dir.to_path_buf(),
            files,
            tensors: shard_files(dir)?,
            tensor_prefix: String::new(),
            digests: Vec::new(),
        })
    }

    /// The path of a checkpoint file, if the model has it.
    pub fn file(&self, name: &str) -> Option<&Path> {
        self.files.get(name).map(PathBuf::as_path)
    }

    /// `config.json`, which every model has.
    pub fn config(&self) -> Result<&Path> {
        self.file("config.json").ok_or_else(|| FileError::Config {
            path: self.origin.join("config.json"),
            message: "missing".into(),
        })
    }

    /// Every file in a fixed order (the named files by name, then the weights), with its name
    /// (`tensors` for a weights file), the digest the store gave it, and whether it holds
    /// weights.
    fn named_files(&self) -> impl Iterator<Item = (&str, &PathBuf, Option<&String>, bool)> {
        let digest = |p: &Path| self.digests.iter().find(|(d, _)| d == p).map(|(_, h)| h);
        let mut names: Vec<(&String, &PathBuf)> = self.files.iter().collect();
        names.sort();
        names
            .into_iter()
            .map(move |(n, p)| (n.as_str(), p, digest(p), false))
            .chain(
                self.tensors
                    .iter()
                    .map(move |p| ("tensors", p, digest(p), true)),
            )
    }

    /// A key that changes whenever what the model computes could: each file's digest where the
    /// store gave one, else its canonical path, length and modification time (hashing a
    /// directory's weights at every start would cost a full read of them). What the prefix
    /// cache's disk tier files blocks under.
    pub fn identity(&self) -> String {
        let mut h = Sha256::new();
        for (name, path, digest, _) in self.named_files() {
            h.update(name.as_bytes());
            h.update([0]);
            match digest {
                Some(d) => h.update(d.as_bytes()),
                None => {
                    let real = path.canonicalize().unwrap_or_else(|_| path.clone());
                    h.update(real.to_string_lossy().as_bytes());
                    if let Ok(md) = std::fs::metadata(path) {
                        h.update(md.len().to_le_bytes());
                        let t = md
                            .modified()
                            .ok()
                            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                            .unwrap_or_default();
                        h.update(t.as_nanos().to_le_bytes());
                    }
                }
            }
            h.update([0]);
        }
        h.update(self.tensor_prefix.as_bytes());
        hex::encode(h.finalize())
    }

    /// A key that equals another machine's for the same model: each file's digest where the
    /// store gave one; else the content of the small files (configs, tokenizer) and, of each
    /// weights file, its length, its safetensors header (names, dtypes, shapes, offsets) and
    /// its first and last MiB of data. Two copies of a checkpoint that differ only inside a
    /// tensor's middle go unnoticed: hashing every weight at every start of every rank would
    /// cost a full read of the model. What the ranks of a split model compare.
    pub fn content_key(&self) -> std::io::Result<String> {
        use std::io::{Seek, SeekFrom};
        let mut h = Sha256::new();
        for (name, path, digest, weights) in self.named_files() {
            h.update(name.as_bytes());
            h.update([0]);
            if let Some(d) = digest {
                h.update(d.as_bytes());
                continue;
            }
            let mut f = std::fs::File::open(path)?;
            let len = f.metadata()?.len();
            h.update(len.to_le_bytes());
            const PART: u64 = 1 << 20;
            if !weights {
                std::io::copy(&mut f, &mut h)?;
                continue;
            }
            let mut n = [0u8; 8];
            f.read_exact(&mut n)?;
            let head = (8 + u64::from_le_bytes(n)).min(len);
            f.seek(SeekFrom::Start(0))?;
            std::io::copy(&mut (&mut f).take(head.saturating_add(PART)), &mut h)?;
            if len > head + 2 * PART {
                f.seek(SeekFrom::Start(len - PART))?;
                std::io::copy(&mut (&mut f).take(PART), &mut h)?;
            }
            h.update([0]);
        }
        h.update(self.tensor_prefix.as_bytes());
        Ok(hex::encode(h.finalize()))
    }

    /// Checks every file with a digest, reading them on as many threads as there are cores.
    pub fn verify(&self) -> Result<()> {
        if self.digests.is_empty() {
            return Ok(());
        }
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .min(self.digests.len());
        let next = std::sync::atomic::AtomicUsize::new(0);
        let first_error = std::sync::Mutex::new(None);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some((path, want)) = self.digests.get(i) else {
                        return;
                    };
                    if let Err(e) = check_digest(path, want) {
                        first_error.lock().unwrap().get_or_insert(e);
                        return;
                    }
                });
            }
        });
        match first_error.into_inner().unwrap() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// The sha256 of a file, as lowercase hex.
pub fn sha256_file(path: &Path) -> std::io::Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

fn check_digest(path: &Path, want: &str) -> Result<()> {
    let got = sha256_file(path).map_err(|source| FileError::Io {
        path: path.to_path_buf(),
        cause: source,
    })?;
    if got != want {
        return Err(FileError::Config {
            path: path.to_path_buf(),
            message: format!(
                "content does not match its digest (sha256 {got}, expected {want}): the model store is damaged; create the model again"
            ),
        });
    }
    Ok(())
}

/// The safetensors files of a checkpoint directory: those its `model.safetensors.index.json`
/// lists, else every `model*.safetensors`, in name order. None is not an error here: loading
/// says so, after the config has had its say.
pub fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |cause| FileError::Io { path, cause }
    };
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(io(&index))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| FileError::Config {
            path: index.clone(),
            message: format!("not valid JSON: {e}"),
        })?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| FileError::Config {
                path: index.clone(),
                message: "no weight_map object".into(),
            })?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(Value::as_str)
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(FileError::Config {
                path: index,
                message: format!("lists {} which does not exist", missing.display()),
            });
        }
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("model") && n.ends_with(".safetensors"))
        })
        .collect();
    files.sort();
    Ok(files)
}

/// One tensor of a safetensors file's header.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorHeader {
    pub name: String,
    /// The safetensors dtype label (`F32`, `BF16`, `U32`, ...).
    pub dtype: String,
    pub shape: Vec<i32>,
    pub nbytes: u64,
}

/// The header of a safetensors file, without reading any tensor data: its tensors (sorted by
/// name) and its `__metadata__` strings. A header that does not parse, or offsets past the end
/// of the file, are errors naming the file.
pub fn safetensors_header(path: &Path) -> Result<(Vec<TensorHeader>, HashMap<String, String>)> {
    let bad = |message: String| FileError::Config {
        path: path.to_path_buf(),
        message,
    };
    let io = |cause| FileError::Io {
        path: path.to_path_buf(),
        cause,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let len = f.metadata().map_err(io)?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n)
        .map_err(|_| bad("not a safetensors file: shorter than its header length".into()))?;
    let n = u64::from_le_bytes(n);
    if n > len.saturating_sub(8) || n > 100 << 20 {
        return Err(bad(format!(
            "not a safetensors file: a header of {n} bytes in a file of {len}"
        )));
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).map_err(io)?;
    let v: Value = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("the safetensors header is not valid JSON: {e}")))?;
    let map = v
        .as_object()
        .ok_or_else(|| bad("the safetensors header is not an object".into()))?;
    let data = len - 8 - n;
    let mut meta = HashMap::new();
    let mut tensors = Vec::with_capacity(map.len());
    for (name, t) in map {
        if name == "__metadata__" {
            if let Some(m) = t.as_object() {
                for (k, v) in m {
                    if let Some(v) = v.as_str() {
                        meta.insert(k.clone(), v.to_string());
                    }
                }
            }
            continue;
        }
        let entry = || -> Option<TensorHeader> {
            let dtype = t.get("dtype")?.as_str()?.to_string();
            let shape = t
                .get("shape")?
                .as_array()?
                .iter()
                .map(|d| d.as_u64().and_then(|d| i32::try_from(d).ok()))
                .collect::<Option<Vec<i32>>>()?;
            let offsets = t.get("data_offsets")?.as_array()?;
            let (a, b) = (offsets.first()?.as_u64()?, offsets.get(1)?.as_u64()?);
            (a <= b && b <= data).then_some(TensorHeader {
                name: name.clone(),
                dtype,
                shape,
                nbytes: b - a,
            })
        };
        tensors
            .push(entry().ok_or_else(|| bad(format!("tensor {name}: a malformed header entry")))?);
    }
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    Ok((tensors, meta))
}
