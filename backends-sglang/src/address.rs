//! The HTTP address check of the factories (gRPC load addresses are
//! checked by `policy_core::grpc_authority`).

use policy_core::BackendError;

/// Checks an HTTP base address (`http://host:port[/prefix]`) and removes any
/// trailing `/`.
pub(crate) fn http_base(raw: &str) -> Result<String, BackendError> {
    let url = reqwest::Url::parse(raw).map_err(|_| BackendError::InvalidAddress {
        url: raw.to_owned(),
        reason: "not a valid URL",
    })?;
    if url.scheme() != "http" {
        return Err(BackendError::InvalidAddress {
            url: raw.to_owned(),
            reason: "expected an http:// URL (this build has no TLS)",
        });
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(BackendError::InvalidAddress {
            url: raw.to_owned(),
            reason: "missing host",
        });
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(BackendError::InvalidAddress {
            url: raw.to_owned(),
            reason: "expected no query or fragment",
        });
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use policy_core::BackendSpec;

    #[test]
    fn http_addresses() {
        let base =
            |spec: BackendSpec| http_base(spec.load_url.as_deref().unwrap_or(&spec.worker_url));
        assert_eq!(
            base(BackendSpec::new("http://127.0.0.1:30000/")).unwrap(),
            "http://127.0.0.1:30000"
        );
        assert_eq!(
            base(BackendSpec::new("http://w:1").with_load_url("http://m:2")).unwrap(),
            "http://m:2"
        );
        for bad in [
            "127.0.0.1:30000",
            "https://w:1",
            "ftp://w:1",
            "http://w:1/?x=1",
        ] {
            assert!(
                matches!(
                    base(BackendSpec::new(bad)),
                    Err(BackendError::InvalidAddress { .. })
                ),
                "{bad}"
            );
        }
    }
}
