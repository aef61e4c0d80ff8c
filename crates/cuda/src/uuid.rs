use std::fmt;
use std::str::FromStr;

/// A GPU UUID as NVML and nvidia-smi print it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuUuid(pub [u8; 16]);

impl FromStr for GpuUuid {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let hex: String = s
            .strip_prefix("GPU-")
            .or_else(|| s.strip_prefix("MIG-"))
            .unwrap_or(s)
            .chars()
            .filter(|c| *c != '-')
            .collect();
        if hex.len() != 32 {
            return Err(format!("{s:?} is not a GPU UUID"));
        }
        let mut out = [0u8; 16];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|_| format!("{s:?} is not a GPU UUID"))?;
        }
        Ok(Self(out))
    }
}

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = &self.0;
        write!(f, "GPU-")?;
        for (i, x) in b.iter().enumerate() {
            if matches!(i, 4 | 6 | 8 | 10) {
                write!(f, "-")?;
            }
            write!(f, "{x:02x}")?;
        }
        Ok(())
    }
}

/// One entry of a restore's GPU map: the GPU the process was checkpointed on
/// and the one it is restored onto.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuPair {
    pub old: GpuUuid,
    pub new: GpuUuid,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let s = "GPU-5a6b7c8d-1234-5678-9abc-def012345678";
        let u: GpuUuid = s.parse().unwrap();
        assert_eq!(u.to_string(), s);
    }

    #[test]
    fn rejects_garbage() {
        assert!("GPU-xyz".parse::<GpuUuid>().is_err());
        assert!("".parse::<GpuUuid>().is_err());
    }
}
