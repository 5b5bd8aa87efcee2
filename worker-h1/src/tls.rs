//! Trust for `https://` workers: the certificates that may sign a worker's
//! certificate, as one rustls client config shared by every pool made with
//! it.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use rustls::RootCertStore;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

/// What the router offers in ALPN: it speaks HTTP/1.1 to its workers.
const ALPN_HTTP1: &[u8] = b"http/1.1";

/// The certificates `https://` workers are verified against, as a rustls
/// client config (TLS 1.2 and 1.3 on ring, ALPN `http/1.1`, no client
/// certificate). Cloning it is cheap: the pools and clients made with one
/// share its config, and with it its TLS session cache.
#[derive(Debug, Clone)]
pub struct WorkerTls {
    config: Arc<rustls::ClientConfig>,
}

/// Why the trust for `https://` workers could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("cannot read the CA file {}", path.display())]
    CaFileUnreadable {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the CA file {} is not valid PEM", path.display())]
    CaFileBadPem {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("the CA file {} holds no certificate", path.display())]
    CaFileEmpty { path: PathBuf },
    #[error("a certificate in the CA file {} cannot be a trust anchor", path.display())]
    CaFileBadCertificate {
        path: PathBuf,
        #[source]
        source: rustls::Error,
    },
    #[error("cannot load the system's root certificates")]
    SystemRoots(#[source] SystemRootsError),
    #[error("cannot build the TLS client configuration")]
    Rustls(#[source] rustls::Error),
}

/// Why the system's root certificates could not be loaded. Kept once per
/// process, so it is shared rather than owned.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SystemRootsError {
    #[error("the system's certificate store could not be read")]
    Unreadable(#[source] Arc<rustls_native_certs::Error>),
    #[error("the system's certificate store holds no usable root certificate")]
    Empty,
}

impl WorkerTls {
    /// The system's root certificates (`rustls-native-certs`: the
    /// platform's store, or `SSL_CERT_FILE` / `SSL_CERT_DIR`). They are read
    /// once per process, on the first call; later calls share that config
    /// (or that error).
    pub fn system_roots() -> Result<WorkerTls, TlsConfigError> {
        static SYSTEM_ROOTS: OnceLock<Result<WorkerTls, SystemRootsError>> = OnceLock::new();
        SYSTEM_ROOTS
            .get_or_init(load_system_roots)
            .clone()
            .map_err(TlsConfigError::SystemRoots)
    }

    /// The certificates of the PEM file at `path` (one or more, any of
    /// which may sign a worker's certificate), and nothing else. The file
    /// is read now, once.
    pub fn from_ca_file(path: &Path) -> Result<WorkerTls, TlsConfigError> {
        let certificates = read_certificates(path)?;
        let mut roots = RootCertStore::empty();
        for certificate in certificates {
            roots
                .add(certificate)
                .map_err(|source| TlsConfigError::CaFileBadCertificate {
                    path: path.to_owned(),
                    source,
                })?;
        }
        WorkerTls::from_roots(roots).map_err(TlsConfigError::Rustls)
    }

    /// The rustls client config, for a client of your own that should trust
    /// workers as the pools do. Its ALPN list is `http/1.1`.
    pub fn client_config(&self) -> &Arc<rustls::ClientConfig> {
        &self.config
    }

    pub(crate) fn from_roots(roots: RootCertStore) -> Result<WorkerTls, rustls::Error> {
        // An explicit provider: never whichever one the process installed
        // as its default (or none).
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![ALPN_HTTP1.to_vec()];
        Ok(WorkerTls {
            config: Arc::new(config),
        })
    }
}

/// Every certificate of the PEM file at `path`; at least one.
fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let pem_error = |error| match error {
        rustls_pki_types::pem::Error::Io(source) => TlsConfigError::CaFileUnreadable {
            path: path.to_owned(),
            source,
        },
        source => TlsConfigError::CaFileBadPem {
            path: path.to_owned(),
            source,
        },
    };
    let certificates = CertificateDer::pem_file_iter(path)
        .map_err(pem_error)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_error)?;
    if certificates.is_empty() {
        return Err(TlsConfigError::CaFileEmpty {
            path: path.to_owned(),
        });
    }
    Ok(certificates)
}

fn load_system_roots() -> Result<WorkerTls, SystemRootsError> {
    let loaded = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    // A store usually holds a few certificates rustls cannot use (old
    // formats, odd extensions): skipped, as every rustls client does.
    let (_added, _skipped) = roots.add_parsable_certificates(loaded.certs);
    if roots.is_empty() {
        return Err(match loaded.errors.into_iter().next() {
            Some(error) => SystemRootsError::Unreadable(Arc::new(error)),
            None => SystemRootsError::Empty,
        });
    }
    // Building with ring's safe defaults does not fail; were it to, the
    // store is as good as empty.
    WorkerTls::from_roots(roots).map_err(|_rustls| SystemRootsError::Empty)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ca_file_that_is_missing_empty_or_not_pem_is_a_typed_error_naming_it() {
        let dir = std::env::temp_dir().join(format!("worker-h1-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("missing.pem");
        let error = WorkerTls::from_ca_file(&missing).unwrap_err();
        assert!(
            matches!(&error, TlsConfigError::CaFileUnreadable { path, source }
                if path == &missing && source.kind() == std::io::ErrorKind::NotFound),
            "{error:?}"
        );
        assert!(error.to_string().contains("missing.pem"), "{error}");

        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "no PEM here\n").unwrap();
        let error = WorkerTls::from_ca_file(&empty).unwrap_err();
        assert!(
            matches!(&error, TlsConfigError::CaFileEmpty { path } if path == &empty),
            "{error:?}"
        );

        let broken = dir.join("broken.pem");
        std::fs::write(
            &broken,
            "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let error = WorkerTls::from_ca_file(&broken).unwrap_err();
        assert!(
            matches!(&error, TlsConfigError::CaFileBadPem { path, .. } if path == &broken),
            "{error:?}"
        );

        let not_a_certificate = dir.join("garbage-der.pem");
        std::fs::write(
            &not_a_certificate,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        )
        .unwrap();
        let error = WorkerTls::from_ca_file(&not_a_certificate).unwrap_err();
        assert!(
            matches!(&error, TlsConfigError::CaFileBadCertificate { path, .. } if path == &not_a_certificate),
            "{error:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_system_roots_are_loaded_once_and_offer_http1() {
        // The machine's store may be empty; either way the answer is kept.
        match (WorkerTls::system_roots(), WorkerTls::system_roots()) {
            (Ok(first), Ok(second)) => {
                assert!(Arc::ptr_eq(first.client_config(), second.client_config()));
                assert_eq!(first.client_config().alpn_protocols, [b"http/1.1".to_vec()]);
            }
            (Err(first), Err(second)) => assert_eq!(first.to_string(), second.to_string()),
            (first, second) => panic!("{first:?} then {second:?}"),
        }
    }
}
