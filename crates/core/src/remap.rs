//! GPU remapping: restore a process onto other GPUs of the same model.
//!
//! The driver (API 13000+) takes pairs (old UUID -> new UUID) that must cover
//! every GPU the process can see, used or not (measured: one pair of two gives
//! CUDA_ERROR_INVALID_VALUE). Users name only the moves they care about
//! (`0=1`); the rest is completed into a permutation here.

use std::collections::BTreeMap;

/// A GPU as the remap sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    pub index: Option<u32>,
    pub uuid: String,
    pub name: String,
}

/// `OLD=NEW,OLD=NEW`, each side a GPU index of this host or a UUID.
pub fn parse(spec: &str) -> Result<Vec<(String, String)>, String> {
    spec.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|pair| {
            let (a, b) = pair
                .split_once('=')
                .ok_or_else(|| format!("{pair:?} is not OLD=NEW (indices or GPU UUIDs)"))?;
            Ok((a.trim().to_string(), b.trim().to_string()))
        })
        .collect()
}

fn find<'a>(gpus: &'a [Gpu], key: &str) -> Option<&'a Gpu> {
    if let Ok(i) = key.parse::<u32>() {
        return gpus.iter().find(|g| g.index == Some(i));
    }
    let k = key.to_ascii_lowercase();
    gpus.iter().find(|g| g.uuid.to_ascii_lowercase() == k)
}

/// The driver's pairs (old UUID, new UUID) and the bytes each new GPU takes.
pub type Plan = (Vec<(String, String)>, BTreeMap<String, u64>);

/// The full list of pairs, and the bytes each new GPU must take.
///
/// `olds`: every GPU the process can see (where it was checkpointed);
/// `news`: the GPUs it may be restored onto (this host's, as the process sees
/// them); `footprint`: bytes per old UUID.
pub fn plan(
    map: &[(String, String)],
    olds: &[Gpu],
    news: &[Gpu],
    footprint: &BTreeMap<String, u64>,
) -> Result<Plan, String> {
    let mut pairs: Vec<(String, String)> = Vec::new();
    for (a, b) in map {
        let old = find(olds, a).ok_or_else(|| format!("GPU {a} is not one the process can see"))?;
        let new = find(news, b).ok_or_else(|| {
            format!("GPU {b} is not a GPU the process can be restored onto here (it must be on this host and visible to the process)")
        })?;
        if old.name != new.name {
            return Err(format!(
                "GPU {a} is a {} and GPU {b} a {}: a remap needs the same model",
                old.name, new.name
            ));
        }
        if pairs.iter().any(|(o, _)| *o == old.uuid) {
            return Err(format!("GPU {a} is mapped twice"));
        }
        if pairs.iter().any(|(_, n)| *n == new.uuid) {
            return Err(format!("two GPUs are mapped onto GPU {b}"));
        }
        pairs.push((old.uuid.clone(), new.uuid.clone()));
    }
    // Complete: every other old GPU goes to a free new one, its own first.
    let mut free: Vec<&Gpu> = news.iter().filter(|n| !pairs.iter().any(|(_, t)| *t == n.uuid)).collect();
    for old in olds {
        if pairs.iter().any(|(o, _)| *o == old.uuid) {
            continue;
        }
        let pick = free
            .iter()
            .position(|n| n.uuid == old.uuid)
            .or_else(|| free.iter().position(|n| n.name == old.name))
            .ok_or_else(|| format!("no GPU left to restore GPU {} ({}) onto", old.uuid, old.name))?;
        pairs.push((old.uuid.clone(), free.remove(pick).uuid.clone()));
    }
    let mut need = BTreeMap::new();
    for (uuid, bytes) in footprint {
        let new = pairs
            .iter()
            .find(|(o, _)| o == uuid)
            .map(|(_, n)| n.clone())
            .ok_or_else(|| format!("GPU {uuid} of the footprint is not one the process can see"))?;
        *need.entry(new).or_insert(0) += bytes;
    }
    Ok((pairs, need))
}

/// The GPUs a process can see: `CUDA_VISIBLE_DEVICES` from its environment
/// (indices or UUIDs), else every GPU of the host.
pub fn visible_to(pid: i32, host: &[Gpu]) -> Vec<Gpu> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
    let cvd = env
        .split(|b| *b == 0)
        .filter_map(|kv| std::str::from_utf8(kv).ok())
        .find_map(|kv| kv.strip_prefix("CUDA_VISIBLE_DEVICES="))
        .map(str::to_string);
    match cvd {
        None => host.to_vec(),
        Some(list) => list
            .split(',')
            .filter_map(|k| {
                let k = k.trim();
                find(host, k).or_else(|| host.iter().find(|g| g.uuid.starts_with(k) && k.len() > 4)).cloned()
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpus(n: u32, name: &str) -> Vec<Gpu> {
        (0..n).map(|i| Gpu { index: Some(i), uuid: format!("GPU-{i}"), name: name.into() }).collect()
    }

    #[test]
    fn one_move_is_completed_into_a_permutation() {
        let g = gpus(2, "H200");
        let fp: BTreeMap<_, _> = [("GPU-0".to_string(), 100u64)].into();
        let (pairs, need) = plan(&parse("0=1").unwrap(), &g, &g, &fp).unwrap();
        assert_eq!(pairs, [("GPU-0".into(), "GPU-1".into()), ("GPU-1".into(), "GPU-0".into())]);
        assert_eq!(need, [("GPU-1".to_string(), 100)].into());
    }

    #[test]
    fn bad_maps_are_refused() {
        let g = gpus(2, "H200");
        let fp = BTreeMap::new();
        assert!(plan(&parse("0=5").unwrap(), &g, &g, &fp).is_err());
        assert!(plan(&parse("0=1,1=1").unwrap(), &g, &g, &fp).is_err());
        let mut other = gpus(2, "H200");
        other[1].name = "A100".into();
        assert!(plan(&parse("0=1").unwrap(), &g, &other, &fp).unwrap_err().contains("same model"));
        assert!(parse("0-1").is_err());
    }

    #[test]
    fn identity_when_no_map() {
        let g = gpus(3, "H200");
        let (pairs, _) = plan(&[], &g, &g, &BTreeMap::new()).unwrap();
        assert!(pairs.iter().all(|(a, b)| a == b));
    }
}
