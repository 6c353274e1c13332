//! Who may talk to `serve`, as ollama decides it: on a loopback address only requests whose
//! Host names this machine (DNS rebinding), and from browsers only allowed origins (CORS).

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderValue, Method, Request, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct Access {
    /// The listener is on a loopback address (Host checks apply).
    pub loopback: bool,
    /// Allowed origins: exact, or with `*` wildcards.
    pub origins: Vec<String>,
}

impl Access {
    pub fn new(loopback: bool, extra: &[String]) -> Access {
        let mut origins = Vec::new();
        for host in ["localhost", "127.0.0.1", "0.0.0.0", "[::1]"] {
            for scheme in ["http", "https"] {
                origins.push(format!("{scheme}://{host}"));
                origins.push(format!("{scheme}://{host}:*"));
            }
        }
        for o in [
            "app://*",
            "file://*",
            "tauri://*",
            "vscode-webview://*",
            "vscode-file://*",
        ] {
            origins.push(o.to_string());
        }
        origins.extend(
            extra
                .iter()
                .map(|o| o.trim().to_string())
                .filter(|o| !o.is_empty()),
        );
        Access { loopback, origins }
    }

    pub fn origin_allowed(&self, origin: &str) -> bool {
        well_formed(origin) && self.origins.iter().any(|p| origin_matches(p, origin))
    }
}

/// An origin as browsers send it: `scheme://host[:port]`, nothing else. User-info
/// (`http://localhost:80@evil.com`), a path, a query or a fragment is never part of a real one,
/// and would let a wildcard port match another host.
fn well_formed(origin: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    !scheme.is_empty()
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        && !authority.chars().any(|c| {
            matches!(c, '@' | '/' | '\\' | '?' | '#') || c.is_whitespace() || c.is_control()
        })
}

/// A pattern's `:*` is a port: digits only. Any other `*` matches any text.
fn origin_matches(pattern: &str, origin: &str) -> bool {
    match pattern.strip_suffix(":*") {
        Some(base) => {
            origin
                .strip_prefix(base)
                .and_then(|rest| rest.strip_prefix(':'))
                .is_some_and(|port| !port.is_empty() && port.chars().all(|c| c.is_ascii_digit()))
                || (base.contains('*') && wildcard(pattern, origin))
        }
        None => wildcard(pattern, origin),
    }
}

fn wildcard(pattern: &str, s: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == s,
        Some((pre, post)) => {
            s.starts_with(pre)
                && (pre.len()..=s.len())
                    .filter(|&i| s.is_char_boundary(i))
                    .any(|i| wildcard(post, &s[i..]))
        }
    }
}

/// A Host that names this machine.
fn local_host(host: &str) -> bool {
    let name = match host.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) && !h.ends_with(':') => h,
        _ => host,
    };
    let name = name
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_lowercase();
    if let Ok(ip) = name.parse::<std::net::IpAddr>() {
        return ip.is_loopback() || ip.is_unspecified();
    }
    name == "localhost"
        || name.ends_with(".localhost")
        || name.ends_with(".local")
        || name.ends_with(".internal")
        || hostname().is_some_and(|h| h.eq_ignore_ascii_case(&name))
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
}

pub async fn guard(State(access): State<Arc<Access>>, req: Request<Body>, next: Next) -> Response {
    if access.loopback {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if !host.is_empty() && !local_host(host) {
            return (StatusCode::FORBIDDEN, "host not allowed\n").into_response();
        }
    }
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|o| o.to_str().ok())
        .map(String::from);
    let Some(origin) = origin else {
        return next.run(req).await;
    };
    if !access.origin_allowed(&origin) {
        return (StatusCode::FORBIDDEN, "origin not allowed\n").into_response();
    }
    let preflight = req.method() == Method::OPTIONS;
    let mut resp = if preflight {
        StatusCode::NO_CONTENT.into_response()
    } else {
        next.run(req).await
    };
    let h = resp.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&origin) {
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    h.insert(header::VARY, HeaderValue::from_static("Origin"));
    if preflight {
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, PUT, PATCH, DELETE, HEAD, OPTIONS"),
        );
        h.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("Authorization, Content-Type, User-Agent, Accept, X-Requested-With, X-Stainless-Lang, X-Stainless-Package-Version, X-Stainless-OS, X-Stainless-Arch, X-Stainless-Retry-Count, X-Stainless-Runtime, X-Stainless-Runtime-Version, X-Stainless-Async, X-Stainless-Helper-Method, X-Stainless-Poll-Helper, X-Stainless-Custom-Poll-Interval, X-Stainless-Timeout"),
        );
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_origins() {
        assert!(local_host("localhost:11434"));
        assert!(local_host("127.0.0.1"));
        assert!(local_host("[::1]:8080"));
        assert!(local_host("my.localhost"));
        assert!(!local_host("evil.example.com"));
        assert!(!local_host("evil.example.com:11434"));
        let a = Access::new(
            true,
            &[
                "https://app.example.com".into(),
                "chrome-extension://*".into(),
            ],
        );
        assert!(a.origin_allowed("http://localhost:3000"));
        assert!(a.origin_allowed("http://127.0.0.1"));
        assert!(a.origin_allowed("https://app.example.com"));
        assert!(a.origin_allowed("chrome-extension://abc"));
        assert!(!a.origin_allowed("https://evil.example.com"));
        assert!(!a.origin_allowed("http://localhost.evil.com"));
        // User-info, paths and non-numeric ports are never a real origin.
        assert!(!a.origin_allowed("http://localhost:80@evil.com"));
        assert!(!a.origin_allowed("http://localhost@evil.com"));
        assert!(!a.origin_allowed("http://localhost:3000/x"));
        assert!(!a.origin_allowed("http://localhost:3000x"));
        assert!(!a.origin_allowed("http://localhost:"));
        assert!(!a.origin_allowed("chrome-extension://abc@evil.com"));
        assert!(a.origin_allowed("http://[::1]:8080"));
    }
}
