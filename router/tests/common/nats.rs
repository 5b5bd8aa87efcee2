//! A real `nats-server` for the replica-sync tests: found on the PATH (or
//! in /usr/sbin, /usr/bin), installed from Debian's package when missing
//! (`apt-get install -y nats-server`, as `cargo xtask bench` installs
//! nginx), started on a free loopback port and killed on drop.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The `nats-server` binary, installed once per test process if missing.
pub fn nats_server_binary() -> PathBuf {
    static BINARY: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    match BINARY.get_or_init(find_or_install) {
        Ok(path) => path.clone(),
        Err(message) => panic!("{message}"),
    }
}

fn find() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from))
        .map(|dir| dir.join("nats-server"))
        .find(|candidate| candidate.is_file())
}

fn find_or_install() -> Result<PathBuf, String> {
    if let Some(found) = find() {
        return Ok(found);
    }
    eprintln!("nats-server is missing: installing it from Debian (apt-get install -y nats-server)");
    let apt = |args: &[&str]| {
        Command::new("apt-get")
            .args(args)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map_err(|error| format!("could not run apt-get {}: {error}", args.join(" ")))
    };
    // The package lists may be missing or old on a fresh machine.
    apt(&["update"])?;
    let status = apt(&["install", "-y", "--no-install-recommends", "nats-server"])?;
    if !status.success() {
        return Err(format!("apt-get install -y nats-server failed ({status})"));
    }
    find().ok_or_else(|| "nats-server is still missing after apt-get install".to_owned())
}

/// A `nats-server` on `127.0.0.1:<port>`, killed on drop.
pub struct NatsServer {
    pub port: u16,
    pub url: String,
    child: Option<Child>,
}

impl NatsServer {
    /// Starts one on a free port and waits until it accepts connections.
    pub fn start() -> NatsServer {
        let port = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap().port()
        };
        let mut server = NatsServer {
            port,
            url: format!("nats://127.0.0.1:{port}"),
            child: None,
        };
        server.restart();
        server
    }

    /// Kills the server (the clients see their connection drop).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port and waits until it accepts.
    pub fn restart(&mut self) {
        self.stop();
        let child = Command::new(nats_server_binary())
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|error| panic!("could not start nats-server: {error}"));
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not accept connections on port {} within 20 s",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
    }
}
