//! Text in and out: `tokenizer.json` through the `tokenizers` crate, BOS handling from
//! `tokenizer_config.json`, EOS ids from `generation_config.json`, and a streaming decoder that
//! only ever emits text at UTF-8 boundaries.

use crate::config::{token_ids, JsonFile};
use crate::{ModelError, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
    /// Bytes of the longest token string in the vocabulary.
    longest: usize,
    add_bos: Option<bool>,
    bos: Option<u32>,
    eos: Vec<u32>,
}

fn special_token_id(inner: &tokenizers::Tokenizer, v: Option<&Value>) -> Option<u32> {
    let text = match v? {
        Value::String(s) => s.clone(),
        Value::Object(o) => o.get("content")?.as_str()?.to_string(),
        _ => return None,
    };
    inner.token_to_id(&text)
}

impl Tokenizer {
    /// Loads `tokenizer.json` plus the optional `tokenizer_config.json`,
    /// `generation_config.json` and `config.json` of `dir` (the latter two for EOS ids).
    pub fn load(dir: &Path) -> Result<Tokenizer> {
        Self::load_with(|name| dir.join(name))
    }

    /// The same, from a model's files wherever they are.
    pub fn load_files(files: &crate::ModelFiles) -> Result<Tokenizer> {
        Self::load_with(|name| {
            files
                .file(name)
                .map_or_else(|| files.origin.join(name), Path::to_path_buf)
        })
    }

    fn load_with(file: impl Fn(&str) -> PathBuf) -> Result<Tokenizer> {
        let path = file("tokenizer.json");
        if !path.is_file() {
            return Err(ModelError::Tokenizer {
                path,
                message: "missing".into(),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| ModelError::Tokenizer {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let optional = |name: &str| JsonFile::read_optional(&file(name));
        let tcfg = optional("tokenizer_config.json")?;
        let gcfg = optional("generation_config.json")?;
        let mcfg = optional("config.json")?;
        let tval = tcfg.as_ref().map(|f| &f.value);
        let add_bos = tval
            .and_then(|v| v.get("add_bos_token"))
            .and_then(Value::as_bool);
        let bos = special_token_id(&inner, tval.and_then(|v| v.get("bos_token"))).or_else(|| {
            token_ids(gcfg.as_ref().and_then(|g| g.value.get("bos_token_id")))
                .first()
                .copied()
        });
        // EOS: generation_config first (what generation stops on), then config.json (or its
        // text_config), then the tokenizer's eos_token.
        let mut eos = token_ids(gcfg.as_ref().and_then(|g| g.value.get("eos_token_id")));
        if eos.is_empty() {
            if let Some(m) = &mcfg {
                eos = token_ids(m.value.get("eos_token_id"));
                if eos.is_empty() {
                    eos = token_ids(
                        m.value
                            .get("text_config")
                            .and_then(|t| t.get("eos_token_id")),
                    );
                }
            }
        }
        if eos.is_empty() {
            eos.extend(special_token_id(
                &inner,
                tval.and_then(|v| v.get("eos_token")),
            ));
        }
        let longest = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1);
        Ok(Tokenizer {
            inner,
            path,
            longest,
            add_bos,
            bos,
            eos,
        })
    }

    fn err(&self, e: impl std::fmt::Display) -> ModelError {
        ModelError::Tokenizer {
            path: self.path.clone(),
            message: e.to_string(),
        }
    }

    /// Token ids for `text`, with special tokens added exactly as the tokenizer config says:
    /// the post-processor of `tokenizer.json`, corrected by `add_bos_token` when it is set.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let mut ids = self
            .inner
            .encode(text, true)
            .map_err(|e| self.err(e))?
            .get_ids()
            .to_vec();
        if let Some(bos) = self.bos {
            let starts = ids.first() == Some(&bos);
            match self.add_bos {
                Some(true) if !starts => ids.insert(0, bos),
                Some(false) if starts => {
                    let plain = self.inner.encode(text, false).map_err(|e| self.err(e))?;
                    if plain.get_ids().first() != Some(&bos) {
                        ids.remove(0);
                    }
                }
                _ => {}
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| self.err(e))
    }

    /// The text of one token as a client would see it in logprobs.
    pub fn token_text(&self, id: u32) -> String {
        self.decode(&[id]).unwrap_or_default()
    }

    /// The `tokenizer.json` it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// An upper bound on the bytes of text that `tokens` tokens can cover, so that a text longer
    /// than that is known not to fit without tokenizing it (tokenizing megabytes costs seconds
    /// and gigabytes). A token's string in the vocabulary is at least as long as the text it
    /// stands for (byte-level and SentencePiece vocabularies spell a byte with one or more
    /// bytes); normalisation can shrink text up to about threefold (NFKC), hence the margin.
    pub fn max_text_bytes(&self, tokens: usize) -> usize {
        tokens
            .saturating_add(8)
            .saturating_mul(self.longest.max(1))
            .saturating_mul(4)
    }

    /// The first way `other` differs from this tokenizer (the size of the vocabulary, a token's
    /// string at some id, which ids are special tokens), described from `other`'s side; `None`
    /// when they map every id to the same token. A drafter proposes token ids that the target
    /// verifies, so a vocabulary that matches in size only (two ids swapped, say) would make
    /// every draft silently wrong.
    pub fn first_difference(&self, other: &Tokenizer) -> Option<String> {
        let (n, m) = (self.vocab_size(), other.vocab_size());
        if n != m {
            return Some(format!("has {m} tokens, the target's tokenizer {n}"));
        }
        for id in 0..n as u32 {
            let (a, b) = (self.inner.id_to_token(id), other.inner.id_to_token(id));
            if a != b {
                return Some(format!(
                    "maps id {id} to {}, the target's tokenizer to {}",
                    b.map_or("nothing".into(), |t| format!("{t:?}")),
                    a.map_or("nothing".into(), |t| format!("{t:?}")),
                ));
            }
        }
        let special = |t: &Tokenizer| {
            let mut v: Vec<u32> = t
                .inner
                .get_added_tokens_decoder()
                .into_iter()
                .filter(|(_, tok)| tok.special)
                .map(|(id, _)| id)
                .collect();
            v.sort_unstable();
            v
        };
        let (a, b) = (special(self), special(other));
        if a != b {
            let id = a
                .iter()
                .find(|i| !b.contains(i))
                .or_else(|| b.iter().find(|i| !a.contains(i)))
                .copied()
                .unwrap_or_default();
            let (draft, target) = if b.contains(&id) {
                ("treats", "does not")
            } else {
                ("does not treat", "does")
            };
            return Some(format!(
                "{draft} token {id} ({:?}) as special, the target's tokenizer {target}",
                self.inner.id_to_token(id).unwrap_or_default(),
            ));
        }
        None
    }
}

/// Incremental detokenisation: decodes a short window of recent tokens and emits only the new
/// suffix, holding text back while it ends in an incomplete UTF-8 sequence (shown as U+FFFD by
/// byte-fallback decoders) so that a character split across tokens is never emitted broken.
#[derive(Debug, Clone, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Adds a token; returns the text that became final (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        let new = suffix_after(&now, &before);
        if !new.is_empty() && !now.ends_with('\u{FFFD}') {
            let new = new.to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            return Ok(new);
        }
        Ok(String::new())
    }

    /// Whatever is still held back (an incomplete character at the end of generation).
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(suffix_after(&now, &before).to_string())
    }
}

/// What `now` adds after `before`. Byte-fallback decoders can rewrite earlier text when a new
/// byte makes a run invalid (`y` then `0xA5` decodes as two replacement characters), so when
/// `now` does not extend `before` byte for byte, skip as many characters as `before` had.
fn suffix_after<'a>(now: &'a str, before: &str) -> &'a str {
    if let Some(rest) = now.strip_prefix(before) {
        return rest;
    }
    let skip = before.chars().count();
    now.char_indices().nth(skip).map_or("", |(i, _)| &now[i..])
}
