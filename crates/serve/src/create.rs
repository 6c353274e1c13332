//! Creating models over the API, as ollama's CLI does it: checkpoint files are uploaded as
//! blobs (`HEAD`/`POST /api/blobs/sha256:…`), then `POST /api/create` names them (`files`,
//! `draft_files`) or a stored model (`from`), with the quantization, template, system,
//! parameters, messages and license. The work is the store's own `create` (the same checks,
//! the same atomic writes), run off the async threads, one at a time.

use crate::ollama_api::error;
use crate::pipeline::ApiError;
use crate::App;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::sync::Arc;
use tokio::io::AsyncWriteExt;

/// `HEAD /api/blobs/sha256:…`: 200 when the blob is stored, else 404.
pub async fn head_blob(State(app): State<Arc<App>>, Path(digest): Path<String>) -> Response {
    match app.catalog.ours.blob_path(&digest) {
        Err(e) => error(&ApiError::bad(e.to_string())),
        Ok(_) if app.catalog.ours.has_blob(&digest) => StatusCode::OK.into_response(),
        Ok(_) => StatusCode::NOT_FOUND.into_response(),
    }
}

/// `POST /api/blobs/sha256:…`: the body, streamed to disk while hashed; stored under its digest
/// only when the contents match it.
pub async fn post_blob(
    State(app): State<Arc<App>>,
    Path(digest): Path<String>,
    body: Body,
) -> Response {
    match upload(&app, &digest, body).await {
        Ok(Stored::New) => StatusCode::CREATED.into_response(),
        Ok(Stored::Already) => StatusCode::OK.into_response(),
        Err(e) => error(&e),
    }
}

enum Stored {
    New,
    Already,
}

/// The upload's next chunk, `None` at its end; however large the upload, its bytes must keep
/// coming.
async fn next_chunk(
    frames: &mut axum::body::BodyDataStream,
) -> Result<Option<axum::body::Bytes>, ApiError> {
    match tokio::time::timeout(std::time::Duration::from_secs(60), frames.next()).await {
        Ok(Some(frame)) => frame
            .map(Some)
            .map_err(|e| ApiError::bad(format!("reading the upload: {e}"))),
        Ok(None) => Ok(None),
        Err(_) => Err(ApiError::new(408, "the upload stalled for 60 s")),
    }
}

async fn upload(app: &App, digest: &str, body: Body) -> Result<Stored, ApiError> {
    let store = &app.catalog.ours;
    store
        .blob_path(digest)
        .map_err(|e| ApiError::bad(e.to_string()))?;
    if store.has_blob(digest) {
        // Read to its end all the same: a response before the body is read makes the
        // connection unusable, and a client still sending it (ollama's Python client posts
        // without asking first) sees the server hang up instead of the answer.
        let mut frames = body.into_data_stream();
        while next_chunk(&mut frames).await?.is_some() {}
        return Ok(Stored::Already);
    }
    let dir = store.uploads();
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| ApiError::new(500, format!("{}: {e}", dir.display())))?;
    let tmp = dir.join(format!(
        "upload-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    let result = async {
        let mut file = tokio::fs::File::create(&tmp)
            .await
            .map_err(|e| ApiError::new(500, format!("{}: {e}", tmp.display())))?;
        let mut hash = Sha256::new();
        let mut frames = body.into_data_stream();
        while let Some(bytes) = next_chunk(&mut frames).await? {
            hash.update(&bytes);
            file.write_all(&bytes)
                .await
                .map_err(|e| ApiError::new(500, format!("writing the upload: {e}")))?;
        }
        file.sync_all()
            .await
            .map_err(|e| ApiError::new(500, format!("writing the upload: {e}")))?;
        let got = format!("sha256:{}", hex::encode(hash.finalize()));
        if got != digest {
            return Err(ApiError::bad(format!(
                "digest mismatch: the upload is {got}, not {digest}"
            )));
        }
        let (store_root, tmp2, digest) =
            (store.root().to_path_buf(), tmp.clone(), digest.to_string());
        tokio::task::spawn_blocking(move || {
            let st = store::Store::open(store_root);
            let lock = st.lock()?;
            st.adopt_blob(&lock, &tmp2, &digest)
        })
        .await
        .map_err(|e| ApiError::new(500, e.to_string()))?
        .map_err(|e| ApiError::new(500, e.to_string()))
    }
    .await;
    let _ = tokio::fs::remove_file(&tmp).await;
    result.map(|()| Stored::New)
}

/// A checkpoint file's name as `files` gives it: one plain name that a file system can hold.
fn file_name_ok(name: &str) -> Result<(), &'static str> {
    if name.is_empty() || name == "." || name == ".." {
        return Err("not a file name");
    }
    if name.contains(['/', '\\']) {
        return Err("a file name, not a path");
    }
    if name.chars().any(char::is_control) {
        return Err("control characters (NUL included) are not allowed");
    }
    // NAME_MAX on the file systems a store lives on.
    if name.len() > 255 {
        return Err("longer than 255 bytes");
    }
    Ok(())
}

/// A folder of links named as the checkpoint's files, each to its uploaded blob: the
/// checkpoint directory `create` reads.
fn checkpoint_dir(
    app: &App,
    files: &Value,
    what: &str,
) -> Result<Option<tempfile::TempDir>, ApiError> {
    let Some(map) = files.as_object().filter(|m| !m.is_empty()) else {
        return Ok(None);
    };
    let store = &app.catalog.ours;
    std::fs::create_dir_all(store.uploads()).map_err(|e| ApiError::new(500, e.to_string()))?;
    let dir = tempfile::Builder::new()
        .prefix("create-")
        .tempdir_in(store.uploads())
        .map_err(|e| ApiError::new(500, e.to_string()))?;
    for (name, digest) in map {
        file_name_ok(name).map_err(|why| {
            let shown: String = name.chars().take(64).collect();
            let more = if shown.len() < name.len() { "…" } else { "" };
            ApiError::bad(format!("{what}: invalid file name {shown:?}{more}: {why}"))
        })?;
        let digest = digest.as_str().ok_or_else(|| {
            ApiError::bad(format!("{what}: the digest of {name} must be a string"))
        })?;
        let blob = store
            .blob_path(digest)
            .map_err(|e| ApiError::bad(e.to_string()))?;
        if !blob.is_file() {
            return Err(ApiError::bad(format!(
                "{what}: {name} names blob {digest}, which was not uploaded"
            )));
        }
        // A hard link: the importer reads regular files only, and blobs and uploads share the
        // store's file system.
        std::fs::hard_link(&blob, dir.path().join(name))
            .map_err(|e| ApiError::new(500, e.to_string()))?;
    }
    Ok(Some(dir))
}

fn text(v: &Value, key: &str) -> Result<Option<String>, ApiError> {
    match &v[key] {
        Value::Null => Ok(None),
        Value::String(s) if s.is_empty() => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        other => Err(ApiError::bad(format!(
            "{key} must be a string, got {other}"
        ))),
    }
}

fn quant(v: &Value, key: &str) -> Result<Option<store::QuantType>, ApiError> {
    text(v, key)?
        .map(|q| {
            q.parse::<store::QuantType>()
                .map_err(|e| ApiError::bad(format!("{key}: {e}")))
        })
        .transpose()
}

/// The Modelfile a create request describes, and the folders it reads (kept until it is done).
fn modelfile(app: &App, v: &Value) -> Result<(store::Modelfile, Vec<tempfile::TempDir>), ApiError> {
    let located = |value: String| store::modelfile::Located { value, line: 0 };
    let mut mf = store::Modelfile::default();
    let mut keep = Vec::new();
    let from = text(v, "from")?;
    match (checkpoint_dir(app, &v["files"], "files")?, from) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad("give either files or from, not both"));
        }
        (Some(dir), None) => {
            mf.from = Some(located(dir.path().display().to_string()));
            keep.push(dir);
        }
        (None, Some(name)) => {
            let parsed = crate::catalog::Catalog::parse(&name)?;
            if app.catalog.store_of(&parsed).is_none() {
                return Err(ApiError::new(404, format!("model '{name}' not found")));
            }
            mf.from = Some(located(parsed.to_string()));
        }
        (None, None) => return Err(ApiError::bad("neither 'from' or 'files' was specified")),
    }
    if let Some(dir) = checkpoint_dir(app, &v["draft_files"], "draft_files")? {
        mf.draft = Some(located(dir.path().display().to_string()));
        keep.push(dir);
    }
    if let Some(params) = v["parameters"].as_object() {
        for (k, val) in params {
            let typed = store::modelfile::parameter(k, val).map_err(ApiError::bad)?;
            mf.parameters.insert(k.to_ascii_lowercase(), typed);
        }
    } else if !v["parameters"].is_null() {
        return Err(ApiError::bad("parameters must be an object"));
    }
    mf.template = text(v, "template")?;
    if let Some(t) = &mf.template {
        // Stored, it would fail every chat: refused now, with the parser's reason.
        crate::template::check(t).map_err(|e| ApiError::bad(e.to_string()))?;
    }
    mf.system = text(v, "system")?;
    match &v["license"] {
        Value::Null => {}
        Value::String(s) => mf.license.push(s.clone()),
        Value::Array(items) => {
            for l in items {
                mf.license.push(
                    l.as_str()
                        .ok_or_else(|| ApiError::bad("license must be strings"))?
                        .to_string(),
                );
            }
        }
        other => {
            return Err(ApiError::bad(format!(
                "license must be a string, got {other}"
            )))
        }
    }
    for m in v["messages"].as_array().into_iter().flatten() {
        let role = m["role"].as_str().unwrap_or_default().to_lowercase();
        if !matches!(role.as_str(), "system" | "user" | "assistant") {
            return Err(ApiError::bad(format!(
                "messages need a role of system, user or assistant, got {role:?}"
            )));
        }
        mf.messages.push(store::modelfile::Message {
            role,
            content: m["content"].as_str().unwrap_or_default().to_string(),
        });
    }
    Ok((mf, keep))
}

fn status_line(v: Value) -> bytes::Bytes {
    let mut line = serde_json::to_vec(&v).unwrap_or_default();
    line.push(b'\n');
    bytes::Bytes::from(line)
}

/// Imports a Modelfile's parts into the store under a name, as `create` does: the binary hands
/// in the store's importer.
pub type Importer = Arc<
    dyn Fn(
            &store::Store,
            &store::ModelName,
            &store::Modelfile,
            &store::CreateOptions,
        ) -> Result<store::CreateReport, ImportError>
        + Send
        + Sync,
>;

/// Why an import failed.
#[derive(Debug)]
pub struct ImportError {
    pub message: String,
    /// The server's own failure (I/O, MLX), not the request's.
    pub internal: bool,
}

pub async fn create(State(app): State<Arc<App>>, body: crate::body::JsonBody) -> Response {
    let v = match crate::body::json_body(body) {
        Ok(v) => v,
        Err(e) => return error(&e),
    };
    let stream = v["stream"].as_bool().unwrap_or(true);
    let prepared = (|| {
        let name = text(&v, "model")?
            .or(text(&v, "name")?)
            .ok_or_else(|| ApiError::bad("model is required"))?;
        let parsed = crate::catalog::Catalog::parse(&name)?;
        let opts = store::CreateOptions {
            quantize: quant(&v, "quantize")?,
            quantize_draft: quant(&v, "draft_quantize")?,
        };
        let (mf, keep) = modelfile(&app, &v)?;
        Ok::<_, ApiError>((parsed, opts, mf, keep))
    })();
    let (name, opts, mf, keep) = match prepared {
        Ok(p) => p,
        Err(e) => return error(&e),
    };
    let root = app.catalog.ours.root().to_path_buf();
    let creating = app.creating.clone();
    let importer = app.cfg.importer.clone();
    let work = async move {
        // One create at a time: quantizing holds a model's worth of memory.
        let _one = creating.lock().await;
        let result = tokio::task::spawn_blocking(move || {
            let st = store::Store::open(root);
            let r = importer(&st, &name, &mf, &opts);
            drop(keep);
            r
        })
        .await;
        match result {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) if e.internal => Err(ApiError::new(500, e.message)),
            Ok(Err(e)) => Err(ApiError::bad(e.message)),
            Err(e) => Err(ApiError::new(500, format!("create failed: {e}"))),
        }
    };
    if !stream {
        return match work.await {
            Ok(_) => axum::Json(json!({"status": "success"})).into_response(),
            Err(e) => error(&e),
        };
    }
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tokio::spawn(async move {
        let _ = tx
            .send(status_line(json!({"status": "importing model"})))
            .await;
        match work.await {
            Ok(r) => {
                let _ = tx
                    .send(status_line(
                        json!({"status": format!("writing manifest sha256:{}", r.digest)}),
                    ))
                    .await;
                let _ = tx.send(status_line(json!({"status": "success"}))).await;
            }
            Err(e) => {
                let _ = tx.send(status_line(json!({"error": e.message}))).await;
            }
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(
            tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok::<_, std::convert::Infallible>),
        ))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}
