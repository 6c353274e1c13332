//! A store in a temporary folder, a Modelfile beside it, and the fixtures.
#![allow(dead_code)]

use mlx::Dtype;
use models::DtypeChoice;
use std::collections::BTreeSet;
use std::path::PathBuf;
use store::{CreateOptions, ModelName, Store};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
}

pub fn from(name: &str) -> String {
    format!("FROM {}\n", fixture(name).display())
}

pub fn with_draft(target: &str, draft: &str) -> String {
    format!("{}DRAFT {}\n", from(target), fixture(draft).display())
}

pub fn name(s: &str) -> ModelName {
    s.parse().unwrap()
}

pub struct Scratch {
    pub dir: tempfile::TempDir,
    pub store: Store,
}

impl Scratch {
    pub fn new() -> Scratch {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().join("models"));
        Scratch { dir, store }
    }

    /// Writes `text` as the Modelfile and creates `name` from it.
    pub fn create(
        &self,
        name: &str,
        text: &str,
        opts: &CreateOptions,
    ) -> import::Result<store::CreateReport> {
        let p = self.dir.path().join("Modelfile");
        std::fs::write(&p, text).unwrap();
        import::create(&self.store, &name.parse().unwrap(), &p, opts)
    }

    /// The stored target, loaded in float32.
    pub fn load(&self, model: &str) -> models::LoadedModel {
        let r = self.store.resolve(&name(model)).unwrap();
        models::load_files(&r.target, DtypeChoice::Fixed(Dtype::F32)).unwrap()
    }

    /// The blob file names on disk.
    pub fn blobs(&self) -> BTreeSet<String> {
        std::fs::read_dir(self.store.root().join("blobs"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    }
}
