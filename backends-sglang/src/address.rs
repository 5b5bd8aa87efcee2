//! Address checks shared by the factories.

use policy_core::{BackendError, BackendSpec};
use tonic::codegen::http::Uri;
use tonic::transport::Endpoint;

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

/// The separate load address a gRPC backend requires.
pub(crate) fn required_load_url<'s>(
    backend: &str,
    spec: &'s BackendSpec,
) -> Result<&'s str, BackendError> {
    spec.load_url
        .as_deref()
        .ok_or_else(|| BackendError::MissingLoadUrl {
            backend: backend.to_owned(),
        })
}

/// The gRPC endpoint of a `grpc://host:port` load address.
pub(crate) fn grpc_endpoint(url: &str) -> Result<Endpoint, BackendError> {
    let invalid = |reason| BackendError::InvalidAddress {
        url: url.to_owned(),
        reason,
    };
    let authority = url
        .strip_prefix("grpc://")
        .ok_or_else(|| invalid("expected grpc://host:port"))?;
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    if authority.is_empty() || authority.contains(['/', '?', '#', '@']) {
        return Err(invalid("expected grpc://host:port"));
    }
    let uri: Uri = format!("http://{authority}")
        .parse()
        .map_err(|_| invalid("not a valid host:port"))?;
    if uri.host().is_none_or(str::is_empty) {
        return Err(invalid("missing host"));
    }
    match authority.rsplit_once(':').map(|(_, port)| port) {
        None => return Err(invalid("missing port")),
        Some(port) if port.contains(']') => return Err(invalid("missing port")),
        Some(port) if port.parse::<u16>().is_err() => return Err(invalid("invalid port")),
        Some(_) => {}
    }
    Ok(Endpoint::from(uri))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grpc(url: &str) -> Result<String, BackendError> {
        grpc_endpoint(url).map(|endpoint| endpoint.uri().to_string())
    }

    #[test]
    fn grpc_addresses() {
        assert_eq!(
            grpc("grpc://10.0.0.1:30001").unwrap(),
            "http://10.0.0.1:30001/"
        );
        assert!(grpc("grpc://host:1/").is_ok());
        assert!(grpc("grpc://[::1]:50051").is_ok());
        for (bad, reason) in [
            ("http://host:1", "expected grpc://host:port"),
            ("grpc://", "expected grpc://host:port"),
            ("grpc://host", "missing port"),
            ("grpc://host:1/path", "expected grpc://host:port"),
            ("grpc://host:notaport", "invalid port"),
            ("grpc://host:70000", "invalid port"),
            ("grpc://[::1]", "missing port"),
            ("grpc://bad host:1", "not a valid host:port"),
        ] {
            match grpc(bad) {
                Err(BackendError::InvalidAddress { url, reason: got }) => {
                    assert_eq!(url, bad);
                    assert_eq!(got, reason, "{bad}");
                }
                other => panic!("{bad}: {other:?}"),
            }
        }
        let spec = BackendSpec::new("http://w:1");
        let missing = required_load_url("sglang-grpc", &spec);
        assert!(matches!(
            missing,
            Err(BackendError::MissingLoadUrl { backend }) if backend == "sglang-grpc"
        ));
    }

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
