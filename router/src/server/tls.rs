//! TLS in the router: the client listener's certificate (`[server.tls]`),
//! loaded at start and swapped on SIGHUP, and the trust in `https://`
//! workers (`[worker_tls]`) that generation requests, load polls and the
//! control plane share.

use std::path::Path;
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::TlsAcceptor;
use worker_h1::{Pool, TlsConfigError, WorkerTls, wants_tls};

use crate::config::{ListenerTlsConfig, WorkerTlsConfig};
use crate::error::TlsError;

/// What the client listener offers in ALPN: hyper's server speaks both, and
/// a client that can do HTTP/2 gets it.
const LISTENER_ALPN: [&[u8]; 2] = [b"h2", b"http/1.1"];

/// The client listener's TLS: the certificate chain and key of
/// `[server.tls]`, behind a swap so SIGHUP can replace them while
/// connections are accepted. A connection keeps the config it was accepted
/// with.
pub(crate) struct ListenerTls {
    /// The files, as named at start; a reload reads them again.
    files: ListenerTlsConfig,
    config: ArcSwap<ServerConfig>,
}

impl std::fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerTls")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl ListenerTls {
    /// Reads the certificate chain and key now: a file that is missing,
    /// holds no certificate or no key, or a key that does not match the
    /// certificate, is an error naming the file.
    pub(crate) fn load(files: &ListenerTlsConfig) -> Result<ListenerTls, TlsError> {
        Ok(ListenerTls {
            config: ArcSwap::from_pointee(server_config(files)?),
            files: files.clone(),
        })
    }

    /// Reads the same files again and swaps them in for connections
    /// accepted from now on; on error the current ones stay.
    pub(crate) fn reload(&self) -> Result<(), TlsError> {
        let config = server_config(&self.files)?;
        self.config.store(Arc::new(config));
        Ok(())
    }

    /// The acceptor for the next connection: the config in force now.
    pub(crate) fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.config.load_full())
    }

    pub(crate) fn files(&self) -> &ListenerTlsConfig {
        &self.files
    }
}

/// A rustls server config from `files`: TLS 1.2 and 1.3 on ring, no client
/// certificates, ALPN `h2` and `http/1.1`.
fn server_config(files: &ListenerTlsConfig) -> Result<ServerConfig, TlsError> {
    let chain = read_certificate_chain(&files.cert_file)?;
    let key = read_private_key(&files.key_file)?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let rejected = |source| TlsError::Rejected {
        cert_file: files.cert_file.clone(),
        key_file: files.key_file.clone(),
        source,
    };
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(rejected)?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|source| match source {
            rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch) => {
                TlsError::KeyMismatch {
                    cert_file: files.cert_file.clone(),
                    key_file: files.key_file.clone(),
                }
            }
            source => rejected(source),
        })?;
    config.alpn_protocols = LISTENER_ALPN.iter().map(|id| id.to_vec()).collect();
    Ok(config)
}

/// A PEM read error as ours, naming `path`.
fn pem_error(path: &Path, error: rustls_pki_types::pem::Error) -> TlsError {
    let path = path.to_owned();
    match error {
        rustls_pki_types::pem::Error::Io(source)
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            TlsError::Missing { path, source }
        }
        rustls_pki_types::pem::Error::Io(source) => TlsError::Unreadable { path, source },
        source => TlsError::BadPem { path, source },
    }
}

/// Every certificate in the PEM file, leaf first; at least one.
fn read_certificate_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(|error| pem_error(path, error))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| pem_error(path, error))?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(chain)
}

/// The first private key in the PEM file (PKCS#8, PKCS#1 or SEC1).
fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|error| match error {
        rustls_pki_types::pem::Error::NoItemsFound => TlsError::NoPrivateKey {
            path: path.to_owned(),
        },
        error => pem_error(path, error),
    })
}

/// How the router trusts `https://` workers (`[worker_tls]`): the
/// certificates of `ca_file`, read at start, or else the system's roots,
/// read when the first `https://` worker needs them, so a router of plain
/// workers never reads the system's store.
#[derive(Debug, Clone, Default)]
pub(crate) struct WorkerTrust {
    ca_file: Option<WorkerTls>,
}

impl WorkerTrust {
    pub(crate) fn load(config: &WorkerTlsConfig) -> Result<WorkerTrust, TlsConfigError> {
        let ca_file = config
            .ca_file
            .as_deref()
            .map(WorkerTls::from_ca_file)
            .transpose()?;
        Ok(WorkerTrust { ca_file })
    }

    /// The trust for an `https://` worker.
    pub(crate) fn for_https(&self) -> Result<WorkerTls, TlsConfigError> {
        match &self.ca_file {
            Some(tls) => Ok(tls.clone()),
            None => WorkerTls::system_roots(),
        }
    }

    /// The connection pool of the worker at `url`: TLS with this trust for
    /// an `https://` one, plain HTTP otherwise.
    pub(crate) fn pool(&self, url: &str) -> Result<Pool, TlsConfigError> {
        if wants_tls(url) {
            Ok(Pool::with_tls(url, self.for_https()?))
        } else {
            Ok(Pool::new(url))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use rcgen::{CertificateParams, KeyPair};

    use super::*;

    /// A scratch directory of this test's own.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("router-tls-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A self-signed certificate for localhost and its key, as PEM.
    fn certificate() -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let certificate = CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (certificate.pem(), key.serialize_pem())
    }

    fn files(dir: &Path, cert: &str, key: &str) -> ListenerTlsConfig {
        let files = ListenerTlsConfig {
            cert_file: dir.join("cert.pem"),
            key_file: dir.join("key.pem"),
        };
        std::fs::write(&files.cert_file, cert).unwrap();
        std::fs::write(&files.key_file, key).unwrap();
        files
    }

    #[test]
    fn each_bad_file_is_its_own_error_naming_the_file() {
        let dir = scratch("errors");
        let (cert, key) = certificate();
        let good = files(&dir, &cert, &key);
        let tls = ListenerTls::load(&good).unwrap();
        let alpn = &tls.config.load().alpn_protocols;
        assert_eq!(alpn, &[b"h2".to_vec(), b"http/1.1".to_vec()]);

        let missing = ListenerTlsConfig {
            cert_file: dir.join("nope.pem"),
            ..good.clone()
        };
        let error = ListenerTls::load(&missing).unwrap_err();
        assert!(
            matches!(&error, TlsError::Missing { path, .. } if path == &missing.cert_file),
            "{error:?}"
        );
        assert!(error.to_string().contains("nope.pem"), "{error}");

        // The key where the certificate should be.
        let swapped = ListenerTlsConfig {
            cert_file: good.key_file.clone(),
            key_file: good.cert_file.clone(),
        };
        let error = ListenerTls::load(&swapped).unwrap_err();
        assert!(
            matches!(&error, TlsError::NoCertificate { path } if path == &good.key_file),
            "{error:?}"
        );
        let no_key = ListenerTlsConfig {
            key_file: good.cert_file.clone(),
            ..good.clone()
        };
        let error = ListenerTls::load(&no_key).unwrap_err();
        assert!(
            matches!(&error, TlsError::NoPrivateKey { path } if path == &good.cert_file),
            "{error:?}"
        );

        let (_, other_key) = certificate();
        let mismatched_dir = scratch("mismatch");
        let mismatched = files(&mismatched_dir, &cert, &other_key);
        let error = ListenerTls::load(&mismatched).unwrap_err();
        assert!(
            matches!(&error, TlsError::KeyMismatch { cert_file, key_file }
                if cert_file == &mismatched.cert_file && key_file == &mismatched.key_file),
            "{error:?}"
        );

        let broken_dir = scratch("broken");
        let broken = files(
            &broken_dir,
            "-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
            &key,
        );
        let error = ListenerTls::load(&broken).unwrap_err();
        assert!(
            matches!(&error, TlsError::BadPem { path, .. } if path == &broken.cert_file),
            "{error:?}"
        );
        for dir in [dir, mismatched_dir, broken_dir] {
            std::fs::remove_dir_all(dir).unwrap();
        }
    }

    #[test]
    fn a_reload_swaps_in_new_files_and_keeps_the_old_ones_on_error() {
        let dir = scratch("reload");
        let (cert, key) = certificate();
        let files = files(&dir, &cert, &key);
        let tls = ListenerTls::load(&files).unwrap();
        let before = tls.config.load_full();

        let (new_cert, new_key) = certificate();
        std::fs::write(&files.cert_file, &new_cert).unwrap();
        std::fs::write(&files.key_file, &new_key).unwrap();
        tls.reload().unwrap();
        let after = tls.config.load_full();
        assert!(!Arc::ptr_eq(&before, &after), "swapped");

        std::fs::write(&files.cert_file, "not a certificate").unwrap();
        assert!(matches!(tls.reload(), Err(TlsError::NoCertificate { .. })));
        assert!(Arc::ptr_eq(&after, &tls.config.load_full()), "kept");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn plain_workers_need_no_trust_and_a_bad_ca_file_fails_at_load() {
        let trust = WorkerTrust::load(&WorkerTlsConfig::default()).unwrap();
        let pool = trust.pool("http://127.0.0.1:1").unwrap();
        assert!(pool.is_usable() && !pool.is_tls());
        let missing = WorkerTlsConfig {
            ca_file: Some(std::env::temp_dir().join("router-no-such-ca.pem")),
        };
        assert!(matches!(
            WorkerTrust::load(&missing),
            Err(TlsConfigError::CaFileUnreadable { .. })
        ));
    }
}
