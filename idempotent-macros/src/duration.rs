//! Duration literals such as `"24h"`, `"90s"` and `"500ms"`, checked at compile time.

/// Parses `<digits><unit>` with units `ms`, `s`, `m`, `h`, `d` into milliseconds.
pub fn parse_millis(text: &str) -> Result<u64, String> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    let scale: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "invalid duration {text:?}: write a whole number followed by a unit, one of ms, s, m, h, d \
                 (for example \"500ms\", \"90s\", \"24h\"), or pass a `std::time::Duration` expression"
            ));
        }
    };
    let number: u64 = number
        .parse()
        .map_err(|_| format!("invalid duration {text:?}: it must start with a whole number, such as \"30s\""))?;
    let millis = number.checked_mul(scale).ok_or_else(|| format!("duration {text:?} is too large"))?;
    if millis == 0 {
        return Err(format!("duration {text:?} is zero: give a positive duration"));
    }
    Ok(millis)
}

#[cfg(test)]
mod tests {
    use super::parse_millis;

    #[test]
    fn durations_parse() {
        assert_eq!(parse_millis("500ms"), Ok(500));
        assert_eq!(parse_millis("90s"), Ok(90_000));
        assert_eq!(parse_millis("15m"), Ok(900_000));
        assert_eq!(parse_millis("24h"), Ok(86_400_000));
        assert_eq!(parse_millis("7d"), Ok(604_800_000));
    }

    #[test]
    fn bad_durations_are_refused() {
        for bad in ["", "10", "h", "1.5h", "10 s", "-1s", "10sec", "0s", "99999999999999999999d"] {
            assert!(parse_millis(bad).is_err(), "{bad:?} should be refused");
        }
    }
}
