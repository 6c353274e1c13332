//! `show NAME`: what a stored model is, in words.

use crate::manifest::{media, Part};
use crate::modelfile::{Located, Message, Modelfile};
use crate::store::{Resolved, Store};
use crate::Result;
use std::fmt::Write;

fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1}M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1}K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

fn part(out: &mut String, p: &Part) {
    let _ = writeln!(out, "    architecture    {}", p.architecture);
    let _ = writeln!(out, "    model type      {}", p.model_type);
    let _ = writeln!(out, "    parameters      {}", count(p.parameter_count));
    match &p.quantization {
        Some(q) => {
            let _ = writeln!(
                out,
                "    quantization    {} ({}-bit {}, group size {})",
                q.kind.to_uppercase(),
                q.bits,
                q.mode,
                q.group_size
            );
            if !q.unquantized.is_empty() {
                let _ = writeln!(
                    out,
                    "    unquantized     {} matrices whose input dimension is not a multiple of {}:",
                    q.unquantized.len(),
                    q.group_size
                );
                for n in &q.unquantized {
                    let _ = writeln!(out, "                      {n}");
                }
            }
        }
        None => {
            let _ = writeln!(out, "    quantization    none ({})", p.file_type);
        }
    }
    let _ = writeln!(out, "    source          {}", p.source);
}

/// The Modelfile a stored model was created from, rebuilt from its layers.
pub fn modelfile(store: &Store, r: &Resolved) -> Result<Modelfile> {
    let located = |value: &str| Located {
        value: value.to_string(),
        line: 0,
    };
    let mut mf = Modelfile {
        from: Some(located(&r.config.part.source)),
        draft: r.config.draft.as_ref().map(|d| located(&d.part.source)),
        ..Modelfile::default()
    };
    for l in &r.manifest.layers {
        match l.media_type.as_str() {
            media::PARAMS => {
                mf.parameters = serde_json::from_str(&store.read_text(l)?).unwrap_or_default();
            }
            media::TEMPLATE => mf.template = Some(store.read_text(l)?),
            media::SYSTEM => mf.system = Some(store.read_text(l)?),
            media::MESSAGES => {
                let m: Vec<Message> =
                    serde_json::from_str(&store.read_text(l)?).unwrap_or_default();
                mf.messages = m;
            }
            media::LICENSE => mf.license.push(store.read_text(l)?),
            _ => {}
        }
    }
    Ok(mf)
}

/// The text `show NAME` prints.
pub fn describe(store: &Store, r: &Resolved) -> Result<String> {
    let mut out = String::new();
    let _ = writeln!(out, "  Model");
    part(&mut out, &r.config.part);
    let size: u64 = r.manifest.all_layers().map(|l| l.size).sum();
    let _ = writeln!(out, "    size            {:.1} MB", size as f64 / 1e6);
    let _ = writeln!(out, "    id              {}", &r.digest[..12]);
    let _ = writeln!(out);
    let _ = writeln!(out, "  Draft");
    match &r.config.draft {
        Some(d) => part(&mut out, &d.part),
        None if r.config.part.mtp_layers > 0 => {
            let _ = writeln!(
                out,
                "    the model's own MTP layer ({} in the checkpoint)",
                r.config.part.mtp_layers
            );
        }
        None => {
            let _ = writeln!(out, "    none");
        }
    }
    let mf = modelfile(store, r)?;
    if !mf.parameters.is_empty() {
        let _ = writeln!(out);
        let _ = writeln!(out, "  Parameters");
        for (k, v) in &mf.parameters {
            let _ = writeln!(out, "    {k:<16}{v}");
        }
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "  Modelfile");
    for line in mf.to_string().lines() {
        let _ = writeln!(out, "    {line}");
    }
    Ok(out)
}
