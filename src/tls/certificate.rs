//! One certificate chain and its key, read from PEM files and checked: the chain parses,
//! the key is one rustls can sign with, and it is the leaf's.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use anyhow::{anyhow, Context};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

use crate::configuration::CertificateFiles;

/// What a leaf certificate says that the gateway uses: the hosts it is for, and its end.
#[derive(Debug, Clone)]
pub(super) struct Leaf {
    /// The chain's file.
    pub(super) file: PathBuf,
    /// Its DNS subject alternative names, lower case (`*.example.com` for a wildcard).
    pub(super) names: Vec<String>,
    /// Its `notAfter`, Unix seconds.
    pub(super) not_after: i64,
}

impl Leaf {
    /// For the log: the file and the names.
    pub(super) fn describe(&self) -> String {
        format!("{} ({})", self.file.display(), self.names.join(", "))
    }
}

/// A file's modification time, size and inode: a change of any means it was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    inode: u64,
}

impl Stamp {
    /// `None` when the file cannot be read (gone, or between a delete and a rename).
    pub(super) fn of(path: &Path) -> Option<Stamp> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::metadata(path).ok()?;
        Some(Stamp {
            modified: meta.modified().ok(),
            len: meta.len(),
            inode: meta.ino(),
        })
    }
}

/// Reads `files`; an error names the key (`at`, such as `tls.` or `tls.sni[0].`, then
/// `cert_file` or `key_file`) and the file, never the key's bytes.
pub(super) fn read(files: &CertificateFiles, at: &str) -> anyhow::Result<(CertifiedKey, Leaf)> {
    let cert_key = format!("{at}cert_file");
    let key_key = format!("{at}key_file");
    let named = |key: &str, path: &Path| format!("{key}: {}", path.display());
    let pem = std::fs::read(&files.cert).with_context(|| named(&cert_key, &files.cert))?;
    let chain = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| {
            anyhow!(
                "{}: not PEM certificates ({e})",
                named(&cert_key, &files.cert)
            )
        })?;
    let leaf_der = chain
        .first()
        .ok_or_else(|| anyhow!("{}: no certificate in it", named(&cert_key, &files.cert)))?;
    let leaf = leaf(leaf_der, &files.cert)
        .map_err(|e| anyhow!("{}: {e}", named(&cert_key, &files.cert)))?;
    let pem = std::fs::read(&files.key).with_context(|| named(&key_key, &files.key))?;
    // The parser's error says only what it found, never the bytes.
    let key = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        anyhow!(
            "{}: no PEM private key (PKCS #8, PKCS #1 or SEC 1) in it ({e})",
            named(&key_key, &files.key)
        )
    })?;
    let certified = CertifiedKey::from_der(chain, key, &rustls::crypto::ring::default_provider())
        .map_err(|e| {
        anyhow!(
            "{}: not the key of the certificate in {} ({e})",
            named(&key_key, &files.key),
            files.cert.display()
        )
    })?;
    Ok((certified, leaf))
}

/// The leaf's names and end.
fn leaf(der: &CertificateDer<'_>, file: &Path) -> Result<Leaf, String> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("the first certificate does not parse ({e})"))?;
    let names = match cert.subject_alternative_name() {
        Ok(Some(san)) => san
            .value
            .general_names
            .iter()
            .filter_map(|n| match n {
                GeneralName::DNSName(name) => Some(name.trim_end_matches('.').to_ascii_lowercase()),
                _ => None,
            })
            .collect(),
        Ok(None) => Vec::new(),
        Err(e) => return Err(format!("its subject alternative names do not parse ({e})")),
    };
    Ok(Leaf {
        file: file.to_owned(),
        names,
        not_after: cert.validity().not_after.timestamp(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn self_signed(names: &[&str]) -> (String, String) {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let c = rcgen::generate_simple_self_signed(names).unwrap();
        (c.cert.pem(), c.signing_key.serialize_pem())
    }

    #[test]
    fn a_certificate_and_its_key_load_with_their_names_and_end() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed(&["API.example.com", "*.example.net"]);
        let files = CertificateFiles {
            cert: write(dir.path(), "c.pem", &cert),
            key: write(dir.path(), "k.pem", &key),
        };
        let (_, leaf) = read(&files, "tls.").unwrap();
        assert_eq!(leaf.names, ["api.example.com", "*.example.net"]);
        assert!(leaf.not_after > 1_700_000_000);
    }

    #[test]
    fn a_key_that_is_not_the_certificates_is_refused_naming_the_key_file() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, _) = self_signed(&["a.test"]);
        let (_, other_key) = self_signed(&["a.test"]);
        let files = CertificateFiles {
            cert: write(dir.path(), "c.pem", &cert),
            key: write(dir.path(), "k.pem", &other_key),
        };
        let e = read(&files, "tls.sni[0].").unwrap_err().to_string();
        assert!(e.starts_with("tls.sni[0].key_file: "), "{e}");
        assert!(e.contains("not the key of the certificate"), "{e}");
        assert!(!e.contains("PRIVATE KEY"), "{e}");
    }

    #[test]
    fn files_without_a_certificate_or_a_key_are_refused_naming_their_key() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = self_signed(&["a.test"]);
        let garbage = write(dir.path(), "g.pem", "not pem at all");
        let cert = write(dir.path(), "c.pem", &cert);
        let key = write(dir.path(), "k.pem", &key);
        let cases = [
            (garbage.clone(), key.clone(), "tls.cert_file: "),
            (cert.clone(), garbage.clone(), "tls.key_file: "),
            (key.clone(), key.clone(), "tls.cert_file: "),
            (
                dir.path().join("missing.pem"),
                key.clone(),
                "tls.cert_file: ",
            ),
        ];
        for (cert, key, named) in cases {
            let e = read(&CertificateFiles { cert, key }, "tls.")
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(named), "{e}");
        }
    }
}
